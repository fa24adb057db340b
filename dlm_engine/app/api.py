"""The engine under the Python API, ``dlm`` and ``dlm-serve``: load a model, decode prompts in batches, collect
per-row results and metrics (no Hydra). The public Python API is the ``dlm_engine`` package (``generate``,
``Session``: :mod:`dlm_engine.app.session`), whose defaults are ``dlm``'s."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.errors import UserError
from dlm_engine.core.steps import BatchSteps, batch_steps
from dlm_engine.core.loop import Sink, decode
from dlm_engine.metrics import (SequenceMetrics, Totals, generated_token_count,  # noqa: F401  (re-exported)
                                tokens_per_forward, totals)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    config: dict
    digest: str
    tokenizer_digest: Optional[str]
    mask_id: int
    eos_id: Optional[int]
    pad_id: int
    device: torch.device
    dtype: torch.dtype
    eot_id: Optional[int] = None          # end-of-turn id (instruct models), from the preset/config/tokenizer
    chat_template: bool = False           # encode() wraps prompts in the tokenizer's chat template
    max_length: Optional[int] = None      # model.max_length: the context limit instead of the config's, if set

    def encode(self, text: str) -> List[int]:
        if self.tokenizer is None:
            raise UserError(f"model '{self.name}' has no tokenizer; pass token ids instead of text")
        if self.chat_template:
            from dlm_engine.models.chat import encode_chat

            return encode_chat(self.tokenizer, text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def vocab_size(self) -> Optional[int]:
        """Rows of the embedding matrix: valid token ids are ``0..vocab_size-1``."""
        v = self.config.get("embedding_size") or self.config.get("vocab_size")
        return int(v) if v else None

    def decode_text(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def load_directory(path: Optional[str] = None, device: str = "cpu", dtype: str = "float32",
                   name: str = "tiny") -> LoadedModel:
    """A checkpoint directory loaded without a Hydra config (scripts, tests, notebooks); by default the
    embedded tiny model. Chat template off, no preset checks."""
    from types import SimpleNamespace

    from dlm_engine.checkpoints import embedded_path

    path = path or embedded_path(name)
    if not path:
        raise UserError(f"no checkpoint directory given and no embedded '{name}' checkpoint is installed")
    return load_model(SimpleNamespace(name=name, path=str(path), random=None, random_seed=0), device, dtype)


_RESOLVE = object()


def load_model(model_cfg, device: str = "auto", dtype: str = "auto", checkpoint=_RESOLVE) -> LoadedModel:
    """Load the model named by a ``model`` config node (a local directory or a seeded random model).
    ``checkpoint``: the directory :func:`dlm_engine.models.checkpoint.check_checkpoint` already resolved for it
    (None: a seeded random model); left out, it is resolved here."""
    from dlm_engine.models.loader import build_random, load_pretrained, resolve_device, resolve_dtype
    from dlm_engine.models.tokenizer import build_char_tokenizer

    from dlm_engine.app.inputs import check_max_length

    max_len = check_max_length(getattr(model_cfg, "max_length", None))
    dev = resolve_device(device)
    tdtype = resolve_dtype(dtype, dev)
    dname = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[tdtype]
    from dlm_engine.models.checkpoint import check_checkpoint

    path = check_checkpoint(model_cfg) if checkpoint is _RESOLVE else checkpoint   # None for seeded random models
    if path is not None:
        from dlm_engine.models.chat import load_tokenizer

        model, raw, digest = load_pretrained(path, device=str(dev), dtype=dname)
        tok, tok_digest = load_tokenizer(path)
    else:
        model, raw, digest = build_random(dict(model_cfg.random), seed=model_cfg.random_seed, device=str(dev), dtype=dname)
        tok, tok_digest = build_char_tokenizer(), "char-ascii-v1"
    from dlm_engine.models.chat import end_of_turn_id, use_chat_template

    cfg = model.config
    eos = getattr(cfg, "eos_token_id", None)
    pad = getattr(cfg, "pad_token_id", None)
    vocab = raw.get("embedding_size") or raw.get("vocab_size")
    eot = end_of_turn_id(raw, tok, getattr(model_cfg, "eot_token_id", None), vocab)
    chat = use_chat_template(str(getattr(model_cfg, "chat_template", "auto") or "auto"),
                             bool(getattr(model_cfg, "instruct", False)), tok, str(path) if path else "")
    return LoadedModel(model=model, tokenizer=tok, name=str(model_cfg.name), config=raw, digest=digest,
                       tokenizer_digest=tok_digest, mask_id=int(cfg.mask_token_id), eos_id=eos,
                       pad_id=int(pad if pad is not None else (eos if eos is not None else 0)), device=dev, dtype=tdtype,
                       eot_id=eot, chat_template=chat, max_length=max_len)


@dataclass
class RowResult:
    """One decoded prompt. ``nfe``, ``generated_tokens``, ``tpf`` and ``latency`` follow
    :mod:`dlm_engine.metrics` (per sequence; they never depend on the batch size)."""

    index: int
    prompt: Optional[str]
    prompt_ids: List[int]
    tokens: List[int]            # generation region
    step_of: List[int]           # generation region: step that committed each position
    text: str
    nfe: int                     # forwards this sequence took part in, until it finished
    steps: int                   # the step after which it was finished
    generated_tokens: int        # up to and including the first EOS
    latency: float = 0.0         # seconds from its batch's decode start to its finish
    edits: int = 0               # writes over a written token (T2T edits), until it finished
    post_edit_nfe: int = 0       # the part of nfe spent in post-edit steps
    extra: dict = field(default_factory=dict)

    @property
    def tpf(self) -> float:
        return tokens_per_forward(self.generated_tokens, self.nfe)

    @property
    def metrics(self) -> Dict[str, Any]:
        out = {"nfe": self.nfe, "generated_tokens": self.generated_tokens, "tpf": self.tpf,
               "latency": self.latency, "steps": self.steps}
        if self.edits or self.post_edit_nfe:          # strategies that rewrite written tokens (edit)
            out.update(edits=self.edits, post_edit_nfe=self.post_edit_nfe)
        return out


def decode_batch(lm: LoadedModel, prompt_ids: Sequence[Sequence[int]], strategy, cache=None,
                 gen_length: int = 16, sinks: Iterable[Sink] = (), canvas_hook=None, fast: bool = True) -> Canvas:
    """Decode one batch of token-id prompts (left-padded) and return the final canvas (``fast=False``: the
    loop's plain path, :func:`dlm_engine.core.loop.decode`)."""
    canvas = Canvas.from_prompts(prompt_ids, gen_length, lm.mask_id, lm.pad_id, device=lm.device,
                                 eos_id=lm.eos_id, eot_id=lm.eot_id)
    if canvas_hook is not None:
        canvas_hook(canvas)
    return decode(lm.model, canvas, strategy, cache=cache, sinks=sinks, fast=fast)


def rows_from_canvas(lm: LoadedModel, canvas: Canvas, prompt_ids, prompts, first_index: int,
                     seq_metrics: Sequence[SequenceMetrics]) -> List[RowResult]:
    g = canvas.gen_start
    toks = canvas.tokens[:, g:].tolist()
    steps = canvas.step_of[:, g:].tolist()
    out = []
    for r, (ids, t, so, m) in enumerate(zip(prompt_ids, toks, steps, seq_metrics)):
        n_gen = m.generated_tokens
        shown = t[:n_gen - 1] if (lm.eos_id is not None and n_gen and t[n_gen - 1] == lm.eos_id) else t[:n_gen]
        out.append(RowResult(
            index=first_index + r, prompt=None if prompts is None else prompts[r], prompt_ids=list(ids),
            tokens=t, step_of=so, text=lm.decode_text([x for x in shown if x != lm.mask_id]),
            nfe=m.nfe, steps=m.finish_step, generated_tokens=n_gen, latency=m.latency,
            edits=m.edits, post_edit_nfe=m.post_edit_nfe,
        ))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RunStats:
    """Rows of a run and its aggregates (:mod:`dlm_engine.metrics`: totals over sequences)."""

    rows: List[RowResult]
    wall_time: float         # decode wall time, device synchronised, after a warm-up call
    model_calls: int         # batched forwards over all batches (depends on the batch size)

    @property
    def totals(self) -> Totals:
        return totals(self.rows, model_calls=self.model_calls, wall_time=self.wall_time)

    @property
    def nfe(self) -> int:
        """Sum of per-sequence NFE."""
        return sum(r.nfe for r in self.rows)

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.rows)

    @property
    def tpf(self) -> float:
        return self.totals.tpf

    @property
    def tps(self) -> float:
        return self.totals.tps


def run_prompts(lm: LoadedModel, prompt_ids: Sequence[Union[str, Sequence[int]]], make_strategy, make_cache,
                gen_length: int, batch_size: int, sinks_for_batch=None, prompts: Optional[Sequence[str]] = None,
                canvas_hook=None, warmup: bool = True, threads: Optional[int] = None, fast: bool = True) -> RunStats:
    """Decode all prompts in batches of ``batch_size`` (a strategy may cap it with ``max_batch``).

    ``prompt_ids``: token-id lists, or strings (encoded with ``lm.encode``; they are then also the rows'
    ``prompt``). Per-sequence metrics come from the batch's one :class:`~dlm_engine.core.steps.BatchSteps` (a trace
    recorder's sink owns it; otherwise one is added as a sink).

    ``make_strategy``: the strategy (one object serves every batch: its per-batch state is ``init_state``'s) or a
    function that builds it, called once; ``make_cache()`` builds a fresh cache per batch; ``sinks_for_batch(i,
    rows)`` returns the sinks of batch ``i``. Wall time covers decoding only (device synchronised, after a warm-up call).
    ``threads``: torch's intra-op CPU threads while decoding (see :func:`torch_threads`; None leaves them).
    ``fast=False``: the loop's plain path (no host-count shortcuts; the same deltas).
    """
    with torch_threads(threads):
        return _run_prompts(lm, prompt_ids, make_strategy, make_cache, gen_length, batch_size, sinks_for_batch,
                            prompts, canvas_hook, warmup, fast)


@contextlib.contextmanager
def torch_threads(n: Optional[int]):
    """torch's intra-op CPU threads set to ``n`` for the block, then put back (None: left as they are). The run
    option ``threads``: on a small model or next to other busy processes (parallel sweep jobs, the trace writer)
    fewer threads than torch's one per core are often faster, and CPU reductions may split differently with
    another count, so a run's count is part of its config."""
    if n is None:
        yield
        return
    if int(n) <= 0:
        raise ValueError(f"threads={n} must be a positive integer")
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_prompts(lm, prompt_ids, make_strategy, make_cache, gen_length, batch_size, sinks_for_batch, prompts,
                 canvas_hook, warmup, fast=True) -> RunStats:
    prompt_ids_given, prompt_ids = prompt_ids, as_token_ids(lm, prompt_ids, gen_length)
    if prompts is None and any(isinstance(p, str) for p in prompt_ids_given):
        prompts = [p if isinstance(p, str) else None for p in prompt_ids_given]
    from dlm_engine.core.strategy import Strategy

    strategy0 = make_strategy if isinstance(make_strategy, Strategy) else make_strategy()
    built = getattr(strategy0, "gen_length", None)
    if built is not None and int(built) != int(gen_length):
        raise UserError(f"gen_length={gen_length} but the strategy was built for gen_length={built} "
                        f"({type(strategy0).__name__}(config, {built})): build it with the same length")
    bs = max(1, int(batch_size))
    if strategy0.max_batch is not None:
        bs = min(bs, strategy0.max_batch)
    if warmup and len(prompt_ids):
        with torch.inference_mode():
            c = Canvas.from_prompts([prompt_ids[0]], gen_length, lm.mask_id, lm.pad_id, device=lm.device)
            lm.model(c.tokens)
        sync(lm.device)
    rows: List[RowResult] = []
    total_time, calls = 0.0, 0
    for b, start in enumerate(range(0, len(prompt_ids), bs)):
        chunk = prompt_ids[start:start + bs]
        sinks = list(sinks_for_batch(b, list(range(start, start + len(chunk)))) if sinks_for_batch else ())
        log = batch_steps(sinks)            # the batch's one step table: a recorder sink's, else a sink of its own
        if log is None:
            log = BatchSteps()
            sinks.insert(0, log)
        sync(lm.device)
        t0 = time.perf_counter()
        canvas = decode_batch(lm, chunk, strategy0, make_cache(), gen_length, sinks, canvas_hook, fast)
        sync(lm.device)
        total_time += time.perf_counter() - t0
        calls += canvas.nfe
        rows.extend(rows_from_canvas(lm, canvas, chunk, None if prompts is None else prompts[start:start + bs], start,
                                     log.metrics(canvas, lm.eos_id)))
    return RunStats(rows=rows, wall_time=total_time, model_calls=calls)


def as_token_ids(lm: LoadedModel, prompts: Sequence[Any], gen_length: int) -> List[List[int]]:
    """Prompts as token-id lists (:func:`dlm_engine.app.inputs.prepare`: strings and ``{"prompt"}`` /
    ``{"messages"}`` objects encoded, ids checked against the vocabulary, lengths against the context); a
    prompt that is none of these is a :class:`UserError` naming it. Unrepresentable characters warn once."""
    import warnings

    from dlm_engine.app.inputs import prepare

    _, ids, warning = prepare(lm, prompts, gen_length, empty_ids=False)   # (dlm and Session pass ids prepare made)
    if warning:
        warnings.warn(warning, UserWarning, stacklevel=3)
    return ids
