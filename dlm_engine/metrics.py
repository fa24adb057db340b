"""Decoding metrics: one set of definitions for every report (``dlm``, ``summary.json``, ``results.jsonl``,
sweep tables and plots, ``dlm-trace``, the Python API, the lm-eval adapter).

Per sequence (one prompt's generation):

* **NFE**: model forward calls the sequence took part in, counted up to and including the step at which it
  finished. A sequence is finished after the step that marked it finished (EOS stop, early exit) or that
  committed its last masked generation position, whichever comes first; steps a strategy still schedules
  after that (LLaDA's zero-transfer steps, the other rows of its batch) cost it nothing.
* **Generated tokens**: tokens of the generation region up to and including the first EOS (all of them when
  there is none); padding, post-EOS filler and prompt tokens never count.
* **TPF**: generated tokens / NFE of that sequence.
* **Latency**: seconds from the start of its batch's decode to the end of its finishing step (host clock).
* **Edits**: writes over a written token (T2T edits, the strategy's per-row ``edits`` step scalar) in the steps
  it took part in until it finished; **post-edit NFE**: the part of its NFE spent in post-edit steps (steps
  that began with no mask left in its block: the strategy's ``post_edit`` step scalar). Both are 0 for
  strategies that never rewrite; post-edit steps count in NFE (and so lower TPF) like every other forward.

Aggregates are totals over sequences: NFE = sum of sequence NFE, TPF = sum of tokens / sum of NFE (never a
mean of ratios), TPS = sum of tokens / decode wall time. **Model calls** (batched forwards: one batched
forward counts once) depend on the batch size and are reported under that name only.

Because a sequence's NFE counts only the forwards it took part in until it finished, none of these figures
depends on how many other sequences shared its batches, provided each row's trajectory is itself batch
invariant. Pure Python + numpy: the trace tools use this module without importing torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np

# version of these definitions, stored in result.json: results written under other definitions are stale
METRICS_VERSION = 2


def tokens_per_forward(tokens: int, nfe: int) -> float:
    """TPF: generated tokens / NFE (0 when nothing was decoded)."""
    return tokens / nfe if nfe else 0.0


@dataclass(frozen=True)
class SequenceMetrics:
    nfe: int                 # forwards this sequence took part in, until it finished
    generated_tokens: int    # up to and including the first EOS
    finish_step: int         # the step after which it was finished (0: nothing was decoded)
    latency: float           # seconds from its batch's decode start to its finish
    edits: int = 0           # writes over a written token, until it finished
    post_edit_nfe: int = 0   # the part of nfe spent in post-edit steps

    @property
    def tpf(self) -> float:
        return tokens_per_forward(self.generated_tokens, self.nfe)

    def as_dict(self) -> Dict[str, Any]:
        return dict(asdict(self), tpf=self.tpf)


@dataclass(frozen=True)
class Totals:
    """Aggregates over sequences (sums, and ratios of sums)."""

    sequences: int
    nfe: int                           # sum of per-sequence NFE
    generated_tokens: int
    latency_sum: float
    model_calls: Optional[int] = None  # batched forwards (depends on the batch size)
    wall_time: Optional[float] = None  # decode wall time (device synchronised)
    edits: int = 0                     # sum of per-sequence edits
    post_edit_nfe: int = 0             # sum of per-sequence post-edit NFE

    @property
    def tpf(self) -> float:
        return tokens_per_forward(self.generated_tokens, self.nfe)

    @property
    def nfe_per_sequence(self) -> float:
        return self.nfe / self.sequences if self.sequences else 0.0

    @property
    def latency_mean(self) -> float:
        return self.latency_sum / self.sequences if self.sequences else 0.0

    @property
    def tps(self) -> Optional[float]:
        if self.wall_time is None:
            return None
        return self.generated_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        out = {"sequences": self.sequences, "nfe": self.nfe, "nfe_per_sequence": self.nfe_per_sequence,
               "generated_tokens": self.generated_tokens, "tpf": self.tpf, "latency_mean": self.latency_mean}
        if self.edits or self.post_edit_nfe:
            out.update(edits=self.edits, edits_per_sequence=self.edits / self.sequences if self.sequences else 0.0,
                       post_edit_nfe=self.post_edit_nfe)
        if self.model_calls is not None:
            out["model_calls"] = self.model_calls
        if self.wall_time is not None:
            out["wall_time"] = self.wall_time
            out["tps"] = self.tps
        return out


def generated_token_count(tokens: Sequence[int], eos_id: Optional[int]) -> int:
    """Tokens up to and including the first EOS (all of them when there is none)."""
    t = np.asarray(tokens)
    if eos_id is not None:
        hit = np.flatnonzero(t == eos_id)
        if hit.size:
            return int(hit[0]) + 1
    return int(t.shape[0])


def finish_step(steps: np.ndarray, finished: np.ndarray, step_of: np.ndarray) -> int:
    """The step after which one sequence was finished.

    ``steps`` [S]: step indices; ``finished`` [S]: the sequence marked finished after that step;
    ``step_of`` [L]: its generation region at the end (-1 masked, 0 given, t: committed by step t).
    The earlier of the explicit finish and the step that committed its last masked position; when neither
    happened (the decode stopped with positions still masked), its last step. A strategy that keeps rewriting
    written tokens after its last masked position is filled (LLaDA2.1's post-edit steps: a step that writes
    nothing may end it) marks its finish explicitly: a finish after its last write then stands.
    A block-diffusion strategy marks its finish after the store forward that follows its last commit: that
    forward is one of the sequence's.
    """
    candidates = []
    hit = np.flatnonzero(np.asarray(finished, dtype=bool))
    so = np.asarray(step_of)
    if hit.size:
        candidates.append(int(steps[hit[0]]))
        if so.size and int(steps[hit[0]]) > int(so.max()) >= 1:
            return int(steps[hit[0]])
    if so.size == 0 or bool((so >= 0).all()):
        candidates.append(int(so.max()) if so.size else 0)
    if candidates:
        return min(candidates)
    return int(steps.max()) if len(steps) else 0


def sequence_metrics(steps, nfe, active, finished, wall_time, step_of, tokens, eos_id: Optional[int],
                     edits=None, post_edit=None) -> SequenceMetrics:
    """Metrics of one sequence from its per-step records (``[S]`` arrays; ``active``/``finished``/``edits`` are
    this sequence's column, ``post_edit`` whether each step was a post-edit one) and its final generation region
    (``step_of``, ``tokens`` [L])."""
    steps = np.asarray(steps, dtype=np.int64).reshape(-1)
    end = finish_step(steps, finished, step_of)
    upto = steps <= end
    took_part = upto & np.asarray(active, dtype=bool).reshape(-1)
    per_step = np.asarray(nfe, dtype=np.int64).reshape(-1)
    n = int(per_step[took_part].sum())
    n_edits = int(_per_step(edits, len(steps))[took_part].sum())
    post = _per_step(post_edit, len(steps)).astype(bool)
    post_nfe = int(per_step[took_part & post].sum())
    wall = np.asarray(wall_time, dtype=np.float64).reshape(-1)
    idx = np.flatnonzero(upto)
    latency = float(wall[idx[-1]]) if idx.size else 0.0
    return SequenceMetrics(nfe=n, generated_tokens=generated_token_count(tokens, eos_id), finish_step=end,
                           latency=latency, edits=n_edits, post_edit_nfe=post_nfe)


def _per_step(x, S: int) -> np.ndarray:
    """A per-step scalar as ``[S]`` int64 (zeros when the strategy does not record it; a step without a value
    counts 0)."""
    out = np.zeros(S, dtype=np.int64)
    if x is None:
        return out
    a = np.asarray(x).reshape(-1)[:S]
    if a.dtype == object:                              # JSON scalars: a step without the value holds None
        a = np.where(np.equal(a, None), 0, a)
    out[:a.size] = a.astype(np.int64)
    return out


def _row_scalar(x, S: int, B: int, b: int):
    """Row ``b``'s column of a per-step scalar recorded per row (``[S, B]``) or for the batch (``[S]``)."""
    if x is None:
        return None
    a = np.asarray(x)
    return a.reshape(S, B)[:, b] if a.size == S * B and B > 1 else a.reshape(-1)


def batch_metrics(steps, nfe, active, finished, wall_time, step_of, tokens, eos_id: Optional[int],
                  edits=None, post_edit=None) -> List[SequenceMetrics]:
    """:func:`sequence_metrics` of every row of a batch (``active``/``finished`` [S, B], ``step_of``/``tokens``
    [B, L]; ``edits`` [S, B] and ``post_edit`` [S] or [S, B] when the strategy records them)."""
    step_of, tokens = np.asarray(step_of), np.asarray(tokens)
    B = step_of.shape[0]
    if active is None or len(steps) == 0:  # no step ran
        active = finished = np.zeros((0, B), dtype=bool)
    active = np.asarray(active, dtype=bool).reshape(-1, B)
    finished = np.asarray(finished, dtype=bool).reshape(-1, B)
    S = len(steps)
    return [sequence_metrics(steps, nfe, active[:, b], finished[:, b], wall_time, step_of[b], tokens[b], eos_id,
                             _row_scalar(edits, S, B, b), _row_scalar(post_edit, S, B, b))
            for b in range(B)]


def totals(seqs: Iterable[SequenceMetrics], model_calls: Optional[int] = None,
           wall_time: Optional[float] = None) -> Totals:
    """Totals over sequences (anything with ``nfe``, ``generated_tokens`` and ``latency``)."""
    seqs = list(seqs)
    return Totals(sequences=len(seqs), nfe=sum(s.nfe for s in seqs),
                  generated_tokens=sum(s.generated_tokens for s in seqs),
                  latency_sum=float(sum(s.latency for s in seqs)), model_calls=model_calls, wall_time=wall_time,
                  edits=sum(getattr(s, "edits", 0) for s in seqs),
                  post_edit_nfe=sum(getattr(s, "post_edit_nfe", 0) for s in seqs))


def summary_line(t: Totals) -> str:
    """The figures ``dlm`` prints after a run (and ``dlm-trace show`` under its table)."""
    parts = [f"sequences {t.sequences}", f"NFE/seq {t.nfe_per_sequence:.2f}", f"TPF {t.tpf:.2f}"]
    if t.tps is not None:
        parts.append(f"TPS {t.tps:.1f}")
    parts.append(f"latency {t.latency_mean:.3f}s")
    if t.edits or t.post_edit_nfe:
        n = t.sequences or 1
        parts.append(f"edits/seq {t.edits / n:.2f}  post-edit NFE/seq {t.post_edit_nfe / n:.2f}")
    if t.model_calls is not None:
        parts.append(f"model calls {t.model_calls}")
    return "  ".join(parts)
