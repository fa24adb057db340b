"""Reading traces: :func:`open_trace` -> :class:`Trace` of :class:`Sequence` objects (numpy arrays).

Example (notebook)::

    from dlm_engine.trace import open_trace
    tr = open_trace("outputs/2025-01-01/12-00-00/trace.dlmt")
    seq = tr[0]                       # rows in results.jsonl order
    seq.tokens, seq.step_of           # final generation-region tokens and the step each was committed
    seq.state_at(3)                   # the generation region after step 3 (mask id where still masked)
    seq.steps.nfe, seq.steps.wall_time, seq.steps.scalars["committed"]
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from . import format as fmt
from .format import SeqData, TraceError


@dataclass
class Record:
    offset: int
    kind: int
    payload: memoryview


def scan_records(data, name: str = "trace") -> Tuple[List[Record], Optional[str]]:
    """Every intact record in order, and a one-line description of what stopped the scan (or None)."""
    fmt.check_preamble(data, name)
    mv = memoryview(data)
    pos, n = len(fmt.PREAMBLE), len(data)
    out: List[Record] = []
    problem = None
    H = fmt.REC_HEAD.size
    while pos < n:
        if n - pos < H:
            problem = f"truncated at byte {pos}: {n - pos} bytes of an incomplete record header"
            break
        kind, ln, crc = fmt.REC_HEAD.unpack_from(data, pos)
        if kind not in fmt.KIND_NAMES:
            problem = f"corrupt record header at byte {pos} (unknown record kind {kind})"
            break
        if pos + H + ln > n:
            problem = (f"truncated at byte {pos}: the {fmt.KIND_NAMES[kind]} record there needs {ln} bytes, "
                       f"only {n - pos - H} remain")
            break
        payload = mv[pos + H:pos + H + ln]
        if fmt.record_crc(kind, bytes(mv[pos:pos + 5]), payload) != crc:
            problem = f"corrupt {fmt.KIND_NAMES[kind]} record at byte {pos} (checksum mismatch)"
            break
        out.append(Record(pos, kind, payload))
        pos += H + ln
    return out, problem


@dataclass
class StepTable:
    """Per-step records of one batch (``active``/``finished`` are ``[n_steps, batch_size]``), or of one row
    as ``Sequence.steps`` gives them (``[n_steps]``, per-row scalars sliced to that row)."""

    step: np.ndarray
    nfe: np.ndarray
    wall_time: np.ndarray
    start: np.ndarray
    width: np.ndarray
    active: np.ndarray
    finished: np.ndarray
    scalars: Dict[str, Any] = field(default_factory=dict)
    events: List[tuple] = field(default_factory=list)   # (step, kind, block, start, end, row)

    def __len__(self) -> int:
        return int(self.step.shape[0])

    @classmethod
    def empty(cls, B: int) -> "StepTable":
        z = np.zeros(0, dtype=np.int32)
        return cls(z, z, np.zeros(0), z, z, np.zeros((0, B), bool), np.zeros((0, B), bool))


class BatchInfo:
    def __init__(self, meta: dict, arrays: dict):
        self.index = int(meta["batch"])
        self.rows: List[int] = [int(r) for r in meta["rows"]]
        self.gen_start = int(meta["gen_start"])
        self.length = int(meta["length"])
        self.mask_id = int(meta["mask_id"])
        self.info = meta.get("info", {})
        self.rng_sha256 = meta.get("rng_sha256")
        self.prompt_tokens = arrays["prompt_tokens"]
        self.prompt_mask = arrays["prompt_mask"]
        self._chunks: List[Tuple[dict, dict]] = []
        self.end: Optional[dict] = None
        self._steps: Optional[StepTable] = None

    @property
    def complete(self) -> bool:
        return self.end is not None

    @property
    def steps(self) -> StepTable:
        if self._steps is None:
            try:
                self._steps = _merge_steps(self._chunks, len(self.rows))
            except (KeyError, ValueError, TypeError, IndexError) as exc:
                raise TraceError(f"batch {self.index}: malformed step records ({type(exc).__name__}: {exc})") from None
        return self._steps


def _merge_steps(chunks, B: int) -> StepTable:
    if not chunks:
        return StepTable.empty(B)
    cat = lambda k: np.concatenate([a[k] for _, a in chunks])  # noqa: E731
    step = np.concatenate([a["step"].astype(np.int64) if "step" in a else np.arange(m["step0"], m["step0"] + int(m["n"]))
                           for m, a in chunks])
    wall = np.concatenate([np.cumsum(a["wall_dus"]) / 1e6 for _, a in chunks])
    tab = StepTable(step, cat("nfe"), wall, cat("start"), cat("width"), cat("active"), cat("finished"))
    names: List[str] = []
    for m, a in chunks:
        for k in [x[2:] for x in a if x[:2] in ("s:", "p:")] + list(m.get("json_scalars", {})):
            if k not in names:
                names.append(k)
    for k in names:
        parts, ok = [], True
        for m, a in chunks:
            n = int(m["n"])
            if "s:" + k in a:
                v = a["s:" + k].astype(np.float64) if a["s:" + k].dtype.kind == "f" else a["s:" + k]
                if "p:" + k in a:   # present in some steps only: NaN elsewhere
                    v = np.where(a["p:" + k].reshape((-1,) + (1,) * (v.ndim - 1)), v.astype(np.float64), np.nan)
                parts.append(v)
            elif k in m.get("json_scalars", {}):
                parts.append(m["json_scalars"][k])
                ok = False
            else:
                parts.append(n)    # absent from this chunk: filled below
        shape = next((p.shape[1:] for p in parts if isinstance(p, np.ndarray)), None)
        for j, p in enumerate(parts):
            if isinstance(p, int):
                if ok and shape is not None:
                    parts[j] = np.full((p,) + shape, np.nan)
                else:
                    parts[j] = [None] * p
                    ok = False
        if ok:
            try:
                tab.scalars[k] = np.concatenate(parts)
                continue
            except ValueError:
                pass
        tab.scalars[k] = [x for p in parts for x in (p.tolist() if isinstance(p, np.ndarray) else p)]
    base = 0
    for m, _ in chunks:
        for i, kind, block, s, e, row in m.get("events", []):
            tab.events.append((int(tab.step[base + i]), kind, block, s, e, row))
        base += int(m["n"])
    return tab


class Sequence:
    """One row of the run: final tokens, the step each position was committed, and its history."""

    def __init__(self, trace: "Trace", batch: BatchInfo, slot: int, payload: memoryview):
        self.trace, self.batch, self.slot = trace, batch, slot
        self._payload = payload
        self._data: Optional[SeqData] = None
        self._key: Optional[np.ndarray] = None   # step_of with "never" as +inf: state_at is one comparison

    def _d(self) -> SeqData:
        if self._data is None:
            try:
                self._data = fmt.decode_seq(bytes(self._payload))
            except (TraceError, ValueError, IndexError, OverflowError) as exc:
                raise TraceError(f"{self.trace.name}: sequence record of batch {self.batch.index}: {exc}") from None
            if self._data.tokens.shape[0] != self.batch.length - self.batch.gen_start:
                raise TraceError(f"{self.trace.name}: sequence record of row {self._data.row} has the wrong length")
        return self._data

    # -- basic fields ----------------------------------------------------------------------------------
    @property
    def row(self) -> int:
        return self._d().row

    @property
    def tokens(self) -> np.ndarray:
        """Final tokens of the generation region."""
        return self._d().tokens

    @property
    def step_of(self) -> np.ndarray:
        """-1 masked at the end, 0 given, t >= 1: committed at step t (generation region)."""
        return self._d().step_of

    @property
    def confidence(self) -> Optional[np.ndarray]:
        """Confidence (float16 precision) of each position when it was committed; NaN if never committed."""
        return self._d().confidence

    @property
    def edits(self) -> Optional[Dict[str, np.ndarray]]:
        """Earlier holdings of remasked/overwritten positions: col, token, start, end (held for start <= t < end)."""
        return self._d().edits

    @property
    def topk(self) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(columns, ids [n, k], logits [n, k]) at each committed position's commit step (capture=topk|logits)."""
        d = self._d()
        if d.topk_ids is None:
            return None
        cols = np.flatnonzero(d.step_of >= 1) + self.batch.gen_start
        return cols, d.topk_ids, d.topk_logits

    @property
    def metrics(self):
        """Per-sequence NFE, generated tokens, TPF, finish step and latency (:mod:`dlm_engine.metrics`), from
        this row's step records: forwards after its finish are not counted."""
        from dlm_engine.metrics import sequence_metrics

        tab, i = self.batch.steps, self.slot
        return sequence_metrics(tab.step, tab.nfe, tab.active[:, i], tab.finished[:, i], tab.wall_time,
                                self.step_of, self.tokens, self.trace.eos_id)

    @property
    def nfe(self) -> int:
        """Forwards this sequence took part in, until it finished (``metrics.nfe``)."""
        return self.metrics.nfe

    @property
    def tpf(self) -> float:
        return self.metrics.tpf

    @property
    def finish_step(self) -> int:
        return self._d().finish_step

    @property
    def mask_id(self) -> int:
        return self.batch.mask_id

    @property
    def gen_start(self) -> int:
        return self.batch.gen_start

    @property
    def gen_length(self) -> int:
        return self.batch.length - self.batch.gen_start

    @property
    def prompt_ids(self) -> np.ndarray:
        m = self.batch.prompt_mask[self.slot]
        return self.batch.prompt_tokens[self.slot][m]

    @property
    def n_steps(self) -> int:
        """The last step that committed anything in this row."""
        so = self.step_of
        m = int(so.max()) if so.size else 0
        if self.edits is not None and len(self.edits["end"]):
            m = max(m, int(self.edits["end"].max()))
        return max(m, 0)

    # -- states ---------------------------------------------------------------------------------------
    def state_at(self, t: int) -> np.ndarray:
        """The generation region after step ``t`` (``t = 0``: before the first step)."""
        key = self._key
        if key is None:
            d = self._d()
            key = self._key = np.where(d.step_of >= 0, d.step_of, np.iinfo(np.int64).max)
        d = self._data
        out = np.where(key <= t, d.tokens, self.batch.mask_id)
        e = d.edits
        if e is not None:
            sel = (e["start"] <= t) & (t < e["end"])
            if sel.any():
                out[e["col"][sel] - self.batch.gen_start] = e["token"][sel]
        return out

    def canvas_at(self, t: int) -> np.ndarray:
        """The whole canvas row (left-padded prompt + generation region) after step ``t``."""
        return np.concatenate([self.batch.prompt_tokens[self.slot], self.state_at(t)])

    def commits_per_step(self) -> np.ndarray:
        """Positions committed at each step 0..n_steps (edits included)."""
        so = self.step_of
        c = np.bincount(so[so >= 1], minlength=self.n_steps + 1)
        if self.edits is not None and len(self.edits["start"]):
            st = self.edits["start"]
            c += np.bincount(st[st >= 1], minlength=len(c))[:len(c)]
        return c

    def generated_tokens(self) -> int:
        from dlm_engine.metrics import generated_token_count

        return generated_token_count(self.tokens, self.trace.eos_id)

    def output_ids(self) -> List[int]:
        """Generated ids as ``results.jsonl`` shows them: up to the first EOS (excluded), masks dropped."""
        t = self.tokens.tolist()
        n = self.generated_tokens()
        eos = self.trace.eos_id
        shown = t[:n - 1] if (eos is not None and n and t[n - 1] == eos) else t[:n]
        return [x for x in shown if x != self.batch.mask_id]

    @property
    def text(self) -> str:
        return self.trace.decode_text(self.output_ids())

    @property
    def steps(self) -> StepTable:
        """This sequence's steps: those it took part in, ending at its finish (``metrics.finish_step``)."""
        tab = self.batch.steps
        i = self.slot
        B = len(self.batch.rows)
        keep = tab.active[:, i].astype(bool) & (tab.step <= self.metrics.finish_step)
        sc = {}
        for k, v in tab.scalars.items():
            if isinstance(v, np.ndarray) and v.ndim >= 2 and v.shape[1] == B:
                sc[k] = v[keep, i]
            elif isinstance(v, np.ndarray):
                sc[k] = v[keep]
            else:
                sc[k] = [x for x, m in zip(v, keep) if m]
        kept = set(tab.step[keep].tolist())
        ev = [e for e in tab.events if e[5] in (-1, i) and e[0] in kept]
        return StepTable(tab.step[keep], tab.nfe[keep], tab.wall_time[keep], tab.start[keep], tab.width[keep],
                         tab.active[keep, i], tab.finished[keep, i], sc, ev)

    def __repr__(self) -> str:
        return f"<Sequence row={self.row} L={self.gen_length} steps={self.n_steps} nfe={self.nfe}>"


class Trace:
    """A trace file opened for reading. ``problems`` lists what is damaged or missing (empty when intact)."""

    def __init__(self, data: bytes, name: str = "trace", recover: bool = True):
        self.name = name
        self.data = data
        self.size = len(data)
        recs, problem = scan_records(data, name)
        self.problems: List[str] = []
        if problem:
            self.problems.append(problem)
        if not recs or recs[0].kind != fmt.HEADER:
            raise TraceError(f"{name}: " + (problem or "no header record"))
        try:
            self.header: Dict[str, Any] = json.loads(fmt.zd(bytes(recs[0].payload), limit=64 << 20))
        except (TraceError, ValueError) as exc:
            raise TraceError(f"{name}: unreadable header ({exc})") from None
        self.end: Optional[dict] = None
        self.batches: Dict[int, BatchInfo] = {}
        self._seqs: List[Sequence] = []
        self._logits: Dict[Tuple[int, int], memoryview] = {}
        self.records = recs
        for r in recs[1:]:
            if self.end is not None:
                self.problems.append(f"corrupt: a {fmt.KIND_NAMES[r.kind]} record follows the end record at byte {r.offset}")
                break
            try:
                self._take(r)
            except (TraceError, KeyError, ValueError, TypeError) as exc:
                self.problems.append(f"corrupt {fmt.KIND_NAMES[r.kind]} record at byte {r.offset} ({exc})")
                break
        if self.end is None and not problem:
            self.problems.append("incomplete: no end record (the run was cut off before the trace was closed)")
        elif self.end is not None:
            exp = self.end.get("sha256_before_end")
            end_off = [r.offset for r in recs if r.kind == fmt.END][0]
            if exp != hashlib.sha256(memoryview(data)[:end_off]).hexdigest():
                self.problems.append("corrupt: records were reordered, removed or replaced (file digest mismatch)")
        self._seqs.sort(key=lambda s: s.row)
        for b in self.batches.values():
            if not b.complete:
                self.problems.append(f"lost: batch {b.index} (rows {_span(b.rows)}) has {len(b.steps)} step records "
                                     "but no sequence records")
        exp_rows = self.header.get("rows_expected")
        if exp_rows is not None and len(self._seqs) < int(exp_rows) and (self.problems or self.status != "complete"):
            self.problems.append(f"lost: {int(exp_rows) - len(self._seqs)} of {exp_rows} rows have no sequence record")
        if not recover and self.problems:
            raise TraceError(f"{name}: {self.problems[0]}")
        self._tok = None
        self._tok_loaded = False

    # -- parsing -------------------------------------------------------------------------------------
    def _take(self, r: Record) -> None:
        k = r.kind
        if k == fmt.BATCH:
            meta, arrays = fmt.decode_bundle(bytes(r.payload))
            b = BatchInfo(meta, arrays)
            if b.index in self.batches:
                raise TraceError(f"batch {b.index} appears twice")
            self.batches[b.index] = b
            self._open_batch = b
            self._slot = 0
        elif k == fmt.STEPS:
            meta, arrays = fmt.decode_bundle(bytes(r.payload))
            self._batch(meta["batch"])._chunks.append((meta, arrays))
        elif k == fmt.SEQ:
            b = getattr(self, "_open_batch", None)
            if b is None or b.complete or self._slot >= len(b.rows):
                raise TraceError("sequence record outside a batch")
            seq = Sequence(self, b, self._slot, r.payload)
            if seq.row != b.rows[self._slot]:
                raise TraceError(f"sequence record for row {seq.row}, expected row {b.rows[self._slot]}")
            self._slot += 1
            self._seqs.append(seq)
        elif k == fmt.BATCH_END:
            meta, _ = fmt.decode_bundle(bytes(r.payload))
            b = self._batch(meta["batch"])
            if self._slot != len(b.rows):
                raise TraceError(f"batch {b.index} ends with {self._slot} of {len(b.rows)} sequence records")
            b.end = meta
        elif k == fmt.LOGITS:
            # decoded on demand; only the small index is read here
            meta, _ = fmt.decode_bundle(bytes(r.payload))
            self._logits[(int(meta["batch"]), int(meta["step"]))] = r.payload
        elif k == fmt.END:
            meta, _ = fmt.decode_bundle(bytes(r.payload))
            self.end = meta
        elif k == fmt.HEADER:
            raise TraceError("a second header record")

    def _batch(self, i) -> BatchInfo:
        if int(i) not in self.batches:
            raise TraceError(f"record refers to unknown batch {i}")
        return self.batches[int(i)]

    # -- API -----------------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """``complete``, ``interrupted``, ``failed: ...`` (from the end record) or ``incomplete``."""
        return self.end["status"] if self.end is not None else "incomplete"

    @property
    def ok(self) -> bool:
        return not self.problems and self.status == "complete"

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __getitem__(self, i: int) -> Sequence:
        return self._seqs[i]

    @property
    def sequences(self) -> List[Sequence]:
        return list(self._seqs)

    @property
    def config(self) -> Dict[str, Any]:
        return self.header.get("config", {})

    @property
    def eos_id(self) -> Optional[int]:
        v = self.header.get("model", {}).get("eos_id")
        return None if v is None else int(v)

    @property
    def capture(self) -> str:
        return self.header.get("capture", {}).get("level", "tokens")

    def logits(self, batch: int, step: int) -> Tuple[int, np.ndarray]:
        """``(start, logits[B, W, V])`` of a step (capture=logits), decoded within the recorded error bound."""
        key = (int(batch), int(step))
        if key not in self._logits:
            raise KeyError(f"no logits recorded for batch {batch} step {step} (capture={self.capture})")
        meta, arrays = fmt.decode_bundle(bytes(self._logits[key]))
        return int(meta["start"]), fmt.dequantize_logits(meta, arrays)

    def logit_steps(self) -> List[Tuple[int, int]]:
        return sorted(self._logits)

    @property
    def tokenizer(self):
        if not self._tok_loaded:
            self._tok_loaded = True
            self._tok = load_tokenizer(self.header.get("tokenizer"))
        return self._tok

    def decode_text(self, ids: List[int]) -> str:
        tok = self.tokenizer
        if tok is None:
            return " ".join(str(i) for i in ids)
        return tok.decode(list(ids), skip_special_tokens=True)

    def totals(self):
        """Aggregates over the sequences read (:func:`dlm_engine.metrics.totals`); ``model_calls`` counts the
        batched forwards of every batch."""
        from dlm_engine.metrics import totals

        calls = sum(int(b.steps.nfe.sum()) for b in self.batches.values())
        return totals((s.metrics for s in self), model_calls=calls)

    def summary(self) -> Dict[str, Any]:
        return {"sequences": len(self), "batches": len(self.batches), "status": self.status,
                "problems": list(self.problems), "bytes": self.size}


def _span(rows: List[int]) -> str:
    return f"{rows[0]}..{rows[-1]}" if rows else "none"


def load_tokenizer(spec: Optional[dict]):
    """The tokenizer named in a trace header, or None when it is not available here."""
    if not spec:
        return None
    kind = spec.get("kind")
    if kind == "char":
        from dlm_engine.models.tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    if kind == "hf":
        p = Path(str(spec.get("path", ""))).expanduser()
        if not p.is_dir():
            return None
        try:
            from dlm_engine.models.chat import load_tokenizer as load_checkpoint_tokenizer   # the same loader dlm uses

            tok, digest = load_checkpoint_tokenizer(p)
        except Exception:
            return None
        if tok is None or (spec.get("digest") and digest != spec["digest"]):
            return None          # gone or changed since recording: ids are shown instead of text
        return tok
    return None


def open_trace(path: Union[str, Path], recover: bool = True) -> Trace:
    """Open a trace file (``NAME.partial`` files of interrupted runs too).

    With ``recover=True`` a damaged or truncated file yields every complete record and ``trace.problems``
    says what was lost; with ``recover=False`` any problem raises :class:`TraceError`.
    """
    p = Path(path)
    try:
        if p.is_file() and p.stat().st_size > (64 << 20):   # large (logits) traces: map, do not copy
            import mmap

            with open(p, "rb") as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        else:
            data = p.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{p}: is a directory") from None
    return Trace(data, name=str(p), recover=recover)


def loads(data: bytes, name: str = "trace", recover: bool = True) -> Trace:
    return Trace(bytes(data), name=name, recover=recover)
