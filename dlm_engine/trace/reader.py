"""Reading traces: :func:`open_trace` -> :class:`Trace` of :class:`Sequence` objects (numpy arrays).

Example (notebook)::

    from dlm_engine.trace import open_trace
    tr = open_trace("outputs/2025-01-01/12-00-00/trace.dlmt")
    seq = tr[0]                       # rows in results.jsonl order
    seq.tokens, seq.step_of           # final generation-region tokens and the step each was committed
    seq.state_at(3)                   # the generation region after step 3 (mask id where still masked)
    seq.steps.nfe, seq.steps.wall_time, seq.steps.scalars["committed"]

Reading treats the file as untrusted input. Every size that leads to an allocation is checked against the
limits the header declares (:class:`Limits`: rows per batch, prompt and generation lengths, vocabulary,
capture level) before anything is decompressed; every value is range-checked; records are framed with a
CRC, so ``recover=True`` skips a damaged record, resynchronises on the next intact one and names what was
lost. Nothing here imports torch or transformers.
"""
from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from . import format as fmt
from . import framing, records
from .format import SeqData, TraceError, check_float, check_int, check_type

_TEXT_LOCK = threading.Lock()     # loading a trace's text decoder (Trace.tokenizer)

# --------------------------------------------------------------------------------------------------
# limits: hard caps on what a header may declare, and the defaults for headers that declare nothing
MAX_BATCH = 1 << 16                 # rows per batch
MAX_PROMPT = 1 << 20                # prompt positions (left-padded prompt region)
MAX_GEN = 1 << 20                   # generated positions per row
MAX_ROWS = 1 << 24                  # rows of a run
MAX_VOCAB = 1 << 31                 # token ids < vocabulary
MAX_TOPK = 1024
DEFAULT_BATCH, DEFAULT_PROMPT, DEFAULT_GEN = 4096, 1 << 16, 1 << 16   # headers without a shape section ...
DEFAULT_POSITIONS = 1 << 22         # ... and rows x canvas length of one of their batches
STEPS_PER_RECORD = 4096             # steps in one steps record (the recorder writes <= 96)
SLACK = 1 << 16                     # bytes of metadata any record may carry
STEP_BYTES, STEP_ROW_BYTES = 64, 256  # per step, per step and row: arrays of a steps record (incl. scalars)
STEP_JSON, STEP_ROW_JSON = 256, 128   # the same for its JSON index (block events, non-numeric scalars)


@dataclass(frozen=True)
class Limits:
    """What the header says the file may hold; every record is checked against it before it is decoded."""

    vocab: int = MAX_VOCAB
    batch: int = DEFAULT_BATCH
    prompt: int = DEFAULT_PROMPT
    gen: int = DEFAULT_GEN
    rows: Optional[int] = None        # rows_expected
    topk: Optional[int] = None        # k of capture=topk|logits
    capture: str = "tokens"
    positions: int = DEFAULT_POSITIONS  # rows x canvas length of one batch

    @property
    def max_steps(self) -> int:
        """Steps of one batch (the step loop stops a decode after 4 * gen_length + 64)."""
        return 64 * self.gen + 1024

    @property
    def max_rows(self) -> int:
        return self.rows if self.rows is not None else MAX_ROWS


# header fields and their JSON types (checked on open, so every reader of ``header`` may rely on them)
_HEADER_FIELDS = {"format": str, "created_at": str, "created_unix": (int, float), "package": dict, "versions": dict,
                  "model": dict, "tokenizer": dict, "config": dict, "overrides": list, "seed": int, "rng": dict,
                  "device": str, "dtype": str, "rows_expected": int, "capture": dict, "shape": dict}
_MODEL_FIELDS = {"name": str, "digest": str, "tokenizer_digest": str, "path": str}
_MODEL_IDS = ("mask_id", "eos_id", "pad_id")


def check_header(h: Any) -> Limits:
    """Type-check the header and derive the limits from its facts (``shape``, else ``config``)."""
    check_type(h, dict, "header")
    for k, typ in _HEADER_FIELDS.items():
        if h.get(k) is not None:
            check_type(h[k], typ, f"header field '{k}'")
    for sub in ("package", "versions", "rng"):
        for k, v in (h.get(sub) or {}).items():
            if isinstance(v, (dict, list)) and sub != "package":
                raise TraceError(f"header field '{sub}.{k}' is not a plain value")
    for o in h.get("overrides") or []:
        check_type(o, str, "header field 'overrides' entry")
    if isinstance((h.get("package") or {}).get("git"), (list, str)):
        raise TraceError("header field 'package.git' is not an object")
    model = h.get("model") or {}
    for k, typ in _MODEL_FIELDS.items():
        if model.get(k) is not None:
            check_type(model[k], typ, f"header field 'model.{k}'")
    shape = h.get("shape") or {}
    cfg = h.get("config") or {}
    for k in ("strategy", "cache", "model", "trace", "task"):
        if cfg.get(k) is not None:
            check_type(cfg[k], dict, f"header field 'config.{k}'")
    tok = h.get("tokenizer")
    if tok is not None:
        for k in ("kind", "path", "digest"):
            if tok.get(k) is not None:
                check_type(tok[k], str, f"header field 'tokenizer.{k}'")

    def fact(key: str, hi: int, default: Optional[int], *alts) -> Optional[int]:
        for where, src in (("shape", shape),) + alts:
            v = src.get(key)
            if v is not None:
                return check_int(v, f"header field '{where}.{key}'", 1, hi)
        return default

    vocab = fact("vocab_size", MAX_VOCAB, MAX_VOCAB, ("model", model))
    batch = fact("batch_size", MAX_BATCH, DEFAULT_BATCH, ("config", cfg))
    gen = fact("gen_length", MAX_GEN, DEFAULT_GEN, ("config", cfg))
    prompt = fact("prompt_length", MAX_PROMPT, DEFAULT_PROMPT)
    rows = None if h.get("rows_expected") is None else check_int(h["rows_expected"], "header field 'rows_expected'",
                                                                 0, MAX_ROWS)
    for k in _MODEL_IDS:
        if model.get(k) is not None:
            check_int(model[k], f"header field 'model.{k}'", 0, vocab - 1)
    if h.get("seed") is not None:
        check_int(h["seed"], "header field 'seed'", -(1 << 63), (1 << 64) - 1)
    cap = h.get("capture") or {}
    level = cap.get("level", "tokens")
    if level not in fmt.CAPTURE_LEVELS:
        raise TraceError(f"header field 'capture.level' is {framing._show(level)}, not one of {', '.join(fmt.CAPTURE_LEVELS)}")
    topk = None
    if level in ("topk", "logits"):
        topk = check_int(cap.get("topk"), "header field 'capture.topk'", 1, MAX_TOPK)
    if cap.get("logit_error_bound") is not None:
        check_float(cap["logit_error_bound"], "header field 'capture.logit_error_bound'", 0.0)
    declared = all(shape.get(k) is not None for k in ("batch_size", "prompt_length", "gen_length"))
    positions = batch * (prompt + gen) if declared else min(batch * (prompt + gen), DEFAULT_POSITIONS)
    return Limits(vocab=vocab, batch=batch, prompt=prompt, gen=gen, rows=rows, topk=topk, capture=level,
                  positions=positions)


# --------------------------------------------------------------------------------------------------
# framing: every intact record, resynchronising past damage
@dataclass
class Record:
    offset: int
    kind: int
    payload: memoryview

    @property
    def end(self) -> int:
        return self.offset + fmt.REC_HEAD.size + len(self.payload)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# record kinds whose payload is a zstd frame
_ZSTD_KINDS = frozenset((fmt.HEADER, fmt.LOGITS))


def _frame_at(data, mv, pos: int, n: int) -> Tuple[Optional[Record], str]:
    """The record at ``pos`` if it is intact, else ``(None, why)``."""
    H = fmt.REC_HEAD.size
    if n - pos < H:
        return None, f"truncated at byte {pos}: {n - pos} bytes of an incomplete record header"
    kind, ln, crc = fmt.REC_HEAD.unpack_from(data, pos)
    if kind not in fmt.KIND_NAMES:
        return None, f"corrupt record header at byte {pos} (unknown record kind {kind})"
    if pos + H + ln > n:
        return None, (f"truncated at byte {pos}: the {fmt.KIND_NAMES[kind]} record there needs {ln} bytes, "
                      f"only {n - pos - H} remain")
    payload = mv[pos + H:pos + H + ln]
    if fmt.record_crc(kind, bytes(mv[pos:pos + 5]), payload, bytes(mv[:len(fmt.PREAMBLE)])) != crc:
        return None, f"corrupt {fmt.KIND_NAMES[kind]} record at byte {pos} (checksum mismatch)"
    return Record(pos, kind, payload), ""


def _candidates(data, start: int, n: int, zstd_kinds, chunk: int = 1 << 20):
    """Offsets >= start where a record header could begin: a known kind, a length that fits the file and,
    for zstd kinds, a payload that starts with the zstd magic number (vectorised, in chunks)."""
    H = fmt.REC_HEAD.size
    a = np.frombuffer(data, dtype=np.uint8)
    for lo in range(start, n - H + 1, chunk):
        hi = min(lo + chunk, n - H + 1)
        k = a[lo:hi]
        ok = (k >= 1) & (k <= max(fmt.KIND_NAMES))
        idx = np.flatnonzero(ok)
        if not idx.size:
            continue
        p = idx + lo
        ln = (a[p + 1].astype(np.int64) | (a[p + 2].astype(np.int64) << 8) | (a[p + 3].astype(np.int64) << 16)
              | (a[p + 4].astype(np.int64) << 24))
        keep = p + H + ln <= n
        p, ln = p[keep], ln[keep]
        z = np.isin(a[p], list(zstd_kinds))
        if z.any():
            pz = p[z]
            good = ln[z] >= 4
            m = np.zeros(pz.shape, dtype=bool)
            q = pz[good] + H
            m[good] = ((a[q] == 0x28) & (a[q + 1] == 0xB5) & (a[q + 2] == 0x2F) & (a[q + 3] == 0xFD))
            keep = np.ones(p.shape, dtype=bool)
            keep[np.flatnonzero(z)] = m
            p = p[keep]
        yield from p.tolist()


def scan_frames(data, name: str = "trace") -> Tuple[List[Record], List[Tuple[int, int, str]]]:
    """Every intact record in file order, and the damaged spans ``(start, end, why)`` skipped between them.

    After a damaged record the scan tries the offset its length field points to, then every later offset
    that can start a record; checksum work spent resynchronising is bounded by 16x the file size.
    """
    fmt.check_preamble(data, name)
    mv = memoryview(data)
    n = len(data)
    pos = len(fmt.PREAMBLE)
    out: List[Record] = []
    damage: List[Tuple[int, int, str]] = []
    budget = 16 * n + (1 << 20)
    while pos < n:
        rec, why = _frame_at(data, mv, pos, n)
        if rec is not None:
            out.append(rec)
            pos = rec.end
            continue
        nxt = None
        if n - pos >= fmt.REC_HEAD.size:     # the length field may be intact: try where it points first
            _, ln, _ = fmt.REC_HEAD.unpack_from(data, pos)
            jump = pos + fmt.REC_HEAD.size + ln
            if jump < n and _frame_at(data, mv, jump, n)[0] is not None:
                nxt = jump
        if nxt is None:
            for p in _candidates(data, pos + 1, n, _ZSTD_KINDS):
                _, ln, _ = fmt.REC_HEAD.unpack_from(data, p)
                budget -= ln + fmt.REC_HEAD.size
                if budget < 0:
                    why += "; gave up resynchronising (too many candidate records)"
                    break
                if _frame_at(data, mv, p, n)[0] is not None:
                    nxt = p
                    break
        damage.append((pos, nxt if nxt is not None else n, why))
        if nxt is None:
            break
        pos = nxt
    return out, damage


def scan_records(data, name: str = "trace") -> Tuple[List[Record], Optional[str]]:
    """Every intact record in order, and a one-line description of the first damage (or None)."""
    recs, damage = scan_frames(data, name)
    return recs, (damage[0][2] if damage else None)


# --------------------------------------------------------------------------------------------------
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
    def __init__(self, meta: dict, lim: Limits, payload: bytes):
        """Check a batch record's metadata; its arrays are checked and attached by :meth:`attach`."""
        self.index = check_int(meta.get("batch"), "batch index", 0, MAX_ROWS)
        rows = check_type(meta.get("rows"), list, "batch rows")
        if not 1 <= len(rows) <= lim.batch:
            raise TraceError(f"batch {self.index} has {len(rows)} rows (the header allows 1..{lim.batch})")
        self.rows: List[int] = [check_int(r, "batch row", 0, lim.max_rows - 1) for r in rows]
        if len(set(self.rows)) != len(self.rows):
            raise TraceError(f"batch {self.index} lists a row twice")
        self.gen_start = check_int(meta.get("gen_start"), "batch gen_start", 0, lim.prompt)
        self.length = check_int(meta.get("length"), "batch length", self.gen_start, self.gen_start + lim.gen)
        if len(self.rows) * self.length > lim.positions:
            raise TraceError(f"batch {self.index} of {len(self.rows)} x {self.length} positions exceeds the "
                             f"{lim.positions} the header allows")
        self.mask_id = check_int(meta.get("mask_id"), "batch mask_id", 0, lim.vocab - 1)
        self.info = check_type(meta.get("info", {}), dict, "batch info")
        self.rng_sha256 = meta.get("rng_sha256")
        self.payload = payload
        self._chunks: Dict[int, Tuple[dict, dict, bytes]] = {}   # first step index -> (meta, arrays, payload)
        self.n_steps = 0
        self.next_slot = 0
        self.steps_lost = False
        self.end: Optional[dict] = None
        self._steps: Optional[StepTable] = None

    def attach(self, arrays: dict, lim: Limits) -> None:
        B, P = len(self.rows), self.gen_start
        for name, want in (("prompt_tokens", np.int64), ("prompt_mask", np.bool_)):
            a = arrays.get(name)
            if a is None or a.shape != (B, P) or a.dtype != want:
                raise TraceError(f"batch {self.index}: '{name}' is not a [{B}, {P}] array")
        if len(arrays) != 2:
            raise TraceError(f"batch {self.index}: unexpected arrays")
        self.prompt_tokens = arrays["prompt_tokens"]
        self.prompt_mask = arrays["prompt_mask"]
        fmt.in_range(self.prompt_tokens, 0, lim.vocab - 1, f"batch {self.index}: prompt token id")

    @property
    def complete(self) -> bool:
        return self.end is not None

    @property
    def steps(self) -> StepTable:
        if self._steps is None:
            self._steps = _merge_steps([self._chunks[k][:2] for k in sorted(self._chunks)], len(self.rows))
        return self._steps


_STEP_ARRAYS = {"wall_dus": np.int64, "nfe": np.int32, "start": np.int32, "width": np.int32, "step": np.int32}


def check_steps(meta: dict, arrays: dict, b: BatchInfo, lim: Limits) -> int:
    """Range-check one steps record of batch ``b``; returns its number of steps."""
    n = check_int(meta.get("n"), "steps record size", 1, STEPS_PER_RECORD)
    check_int(meta.get("first"), "steps record start", 0, lim.max_steps)
    B = len(b.rows)
    for k, dt in _STEP_ARRAYS.items():
        a = arrays.get(k)
        if a is None and k == "step":
            continue
        if a is None or a.shape != (n,) or a.dtype != dt:
            raise TraceError(f"steps record of batch {b.index}: '{k}' is not an [{n}] array")
    for k in ("active", "finished"):
        a = arrays.get(k)
        if a is None or a.shape != (n, B) or a.dtype != np.bool_:
            raise TraceError(f"steps record of batch {b.index}: '{k}' is not an [{n}, {B}] array")
    for k, a in arrays.items():
        if k not in _STEP_ARRAYS and k not in ("active", "finished") and not (
                k[:2] in ("s:", "p:") and a.ndim >= 1 and a.shape[0] == n and (k[:2] == "s:" or a.dtype == np.bool_)):
            raise TraceError(f"steps record of batch {b.index}: unexpected array '{k[:40]}'")
    if "step" in arrays:
        steps = arrays["step"].astype(np.int64)
        if "step0" in meta:
            raise TraceError(f"steps record of batch {b.index} has both step0 and a step array")
    else:
        s0 = check_int(meta.get("step0"), "steps record step0", 0, lim.max_steps)
        steps = np.arange(s0, s0 + n, dtype=np.int64)
    fmt.in_range(steps, 0, lim.max_steps, f"batch {b.index}: step")
    if n > 1 and not (np.diff(steps) > 0).all():
        raise TraceError(f"steps record of batch {b.index}: steps are not increasing")
    fmt.in_range(arrays["nfe"], 0, 1 << 20, f"batch {b.index}: per-step NFE")
    fmt.in_range(arrays["wall_dus"], 0, 1 << 50, f"batch {b.index}: wall time (us)")
    fmt.in_range(arrays["start"], 0, b.length, f"batch {b.index}: window start")
    fmt.in_range(arrays["width"], 0, b.length, f"batch {b.index}: window width")
    if bool((arrays["start"].astype(np.int64) + arrays["width"] > b.length).any()):
        raise TraceError(f"steps record of batch {b.index}: a window ends past the canvas")
    events = check_type(meta.get("events", []), list, "steps record events")
    for e in events:
        if not (isinstance(e, list) and len(e) == 6 and isinstance(e[1], str) and len(e[1]) <= 32):
            raise TraceError(f"steps record of batch {b.index}: malformed block event")
        check_int(e[0], "block event step index", 0, n - 1)
        for v in e[2:5]:
            check_int(v, "block event field", -(1 << 40), 1 << 40)
        check_int(e[5], "block event row", -1, B - 1)
    js = check_type(meta.get("json_scalars", {}), dict, "steps record scalars")
    for k, v in js.items():
        if not isinstance(v, list) or len(v) != n:
            raise TraceError(f"steps record of batch {b.index}: scalar '{k[:40]}' does not have {n} values")
    return n


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

    def __init__(self, trace: "Trace", batch: BatchInfo, slot: int, data: SeqData, payload=None):
        self.trace, self.batch, self.slot = trace, batch, slot
        self._data = data
        self._payload = payload
        self._key: Optional[np.ndarray] = None   # step_of with "never" as +inf: state_at is one comparison
        self._metrics = None                     # (the step table it came from, metrics): nfe/tpf/steps share it

    def _d(self) -> SeqData:
        return self._data

    # -- basic fields ----------------------------------------------------------------------------------
    @property
    def row(self) -> int:
        return self._data.row

    @property
    def tokens(self) -> np.ndarray:
        """Final tokens of the generation region."""
        return self._data.tokens

    @property
    def step_of(self) -> np.ndarray:
        """-1 masked at the end, 0 given, t >= 1: committed at step t (generation region)."""
        return self._data.step_of

    @property
    def confidence(self) -> Optional[np.ndarray]:
        """Confidence (float16 precision) of each position when it was committed; NaN if never committed."""
        return self._data.confidence

    @property
    def edits(self) -> Optional[Dict[str, np.ndarray]]:
        """Earlier holdings of remasked/overwritten positions: col, token, start, end (held for start <= t < end)."""
        return self._data.edits

    @property
    def topk(self) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(columns, ids [n, k], logits [n, k]) at each committed position's commit step (capture=topk|logits)."""
        d = self._data
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
        if self._metrics is None or self._metrics[0] is not tab:
            from dlm_engine.metrics import _row_scalar

            S, B = len(tab.step), tab.active.shape[1]
            self._metrics = (tab, sequence_metrics(tab.step, tab.nfe, tab.active[:, i], tab.finished[:, i],
                                                   tab.wall_time, self.step_of, self.tokens, self.trace.eos_id,
                                                   _row_scalar(tab.scalars.get("edits"), S, B, i),
                                                   _row_scalar(tab.scalars.get("post_edit"), S, B, i)))
        return self._metrics[1]

    @property
    def nfe(self) -> int:
        """Forwards this sequence took part in, until it finished (``metrics.nfe``; the recorded count when a
        damaged trace lost its batch's step records)."""
        if self.batch.steps_lost:
            return int(self._data.nfe)
        return self.metrics.nfe

    @property
    def tpf(self) -> float:
        return self.metrics.tpf

    @property
    def finish_step(self) -> int:
        return self._data.finish_step

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
        d = self._data
        if key is None:
            key = self._key = np.where(d.step_of >= 0, d.step_of, np.iinfo(np.int64).max)
        out = np.where(key <= t, d.tokens, self.batch.mask_id)
        e = d.edits
        if e is not None:
            sel = (e["start"] <= t) & (t < e["end"])
            if sel.any():
                out[e["col"][sel] - self.batch.gen_start] = e["token"][sel]
        return out

    def remasked_at(self, t: int) -> np.ndarray:
        """``[gen_length]`` bool: positions masked after step ``t`` that had been decoded before (re-masked,
        e.g. by WINO), as opposed to positions never decoded yet."""
        out = np.zeros(self.gen_length, dtype=bool)
        e = self._data.edits
        if e is not None and len(e["end"]):
            held = e["end"] <= t
            out[e["col"][held] - self.batch.gen_start] = True
            out &= self.state_at(t) == self.batch.mask_id
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


def _span(rows) -> str:
    """``0..3, 7, 9..10``: a compact list of row numbers."""
    rows = sorted(rows)
    out, i = [], 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        out.append(str(rows[i]) if i == j else f"{rows[i]}..{rows[j]}")
        i = j + 1
    return ", ".join(out) if out else "none"


def _rows(rows) -> str:
    """``row 3`` / ``rows 0..2, 5``."""
    return ("row " if len(set(rows)) == 1 else "rows ") + _span(rows)


class Trace:
    """A trace file opened for reading. ``problems`` lists what is damaged or missing (empty when intact).

    With ``recover=False`` the first problem raises :class:`TraceError`; with ``recover=True`` every intact
    complete row is kept and ``problems`` names what was lost (damaged byte spans, rows, step records,
    logits, the end record).
    """

    def __init__(self, data, name: str = "trace", recover: bool = True, tokenizer=None):
        self.name = name
        self.data = data
        self.size = len(data)
        recs, damage = scan_frames(data, name)
        self.records = recs
        self.damage = damage
        # a damaged span that reaches the end of the file is a truncation (or nothing intact follows it)
        self.problems: List[str] = [why if end >= len(data) else f"{why}; bytes {start}..{end - 1} skipped"
                                    for start, end, why in damage]
        if not recover and self.problems:
            raise TraceError(f"{name}: {self.problems[0]}")
        if not recs or recs[0].kind != fmt.HEADER or recs[0].offset != len(fmt.PREAMBLE):
            raise TraceError(f"{name}: " + (self.problems[0] + " (the header is needed to read anything)"
                                            if self.problems else "no header record"))
        try:
            self.header: Dict[str, Any] = fmt.load_json(fmt.zd(bytes(recs[0].payload), limit=fmt.MAX_JSON), "header")
            self.limits = check_header(self.header)
        except TraceError as exc:
            raise TraceError(f"{name}: unreadable header ({exc})") from None
        self._recover = recover
        self.major = struct.unpack_from("<H", data, len(fmt.MAGIC))[0]
        self._batch_defaults = records.batch_defaults(self.header)   # what a batch record may leave out
        self.end: Optional[dict] = None
        self._end_offset: Optional[int] = None
        self.batches: Dict[int, BatchInfo] = {}
        self._row_batch: Dict[int, BatchInfo] = {}
        self._by_row: Dict[int, Sequence] = {}
        self._conflicts: set = set()       # rows with two different intact sequence records
        self._orphans: set = set()         # rows of sequence records whose batch record is missing
        self._logits: Dict[Tuple[int, int], Tuple[memoryview, fmt.BundleHead]] = {}
        for r in recs[1:]:
            if self.end is not None and r.kind != fmt.END:
                self._problem(f"corrupt: a {fmt.KIND_NAMES[r.kind]} record follows the end record at byte {r.offset}",
                              recover)
            try:
                self._take(r)
            except TraceError as exc:
                self._problem(f"corrupt {fmt.KIND_NAMES[r.kind]} record at byte {r.offset} ({exc})", recover)
        for row in self._conflicts:
            self._by_row.pop(row, None)
        self._cross_check(recover)
        self._seqs: List[Sequence] = sorted(self._by_row.values(), key=lambda s: s.row)
        self._tokenizer_dir = tokenizer
        self._text = None
        self._text_loaded = False
        self.notes: List[str] = []

    def _problem(self, msg: str, recover: bool) -> None:
        if not recover:
            raise TraceError(f"{self.name}: {msg}")
        self.problems.append(msg)

    # -- parsing -------------------------------------------------------------------------------------
    def _take(self, r: Record) -> None:
        k, lim = r.kind, self.limits
        if k == fmt.BATCH:
            meta, arrays = records.decode_batch(r.payload, lim, self._batch_defaults, SLACK)
            b = BatchInfo(meta, lim, bytes(r.payload))
            b.attach(arrays, lim)
            old = self.batches.get(b.index)
            if old is not None:
                if old.payload == b.payload:
                    raise TraceError(f"batch {b.index} appears twice (the copy is ignored)")
                raise TraceError(f"batch {b.index} appears twice with different contents")
            clash = [row for row in b.rows if row in self._row_batch]
            if clash:
                raise TraceError(f"batch {b.index} lists rows of another batch ({_span(clash)})")
            self.batches[b.index] = b
            for row in b.rows:
                self._row_batch[row] = b
        elif k == fmt.STEPS:
            c = records.Cursor(r.payload)
            b = self._batch(c.varint("batch index", MAX_ROWS))
            meta, arrays = self._table(c, b)
            self._add_steps(b, meta, arrays, bytes(r.payload))
        elif k == fmt.SEQ:
            row, _ = fmt.get_varint(r.payload, 0)
            b = self._row_batch.get(row)
            if b is None:
                self._orphans.add(row)
                raise TraceError(f"sequence record for row {row} outside any intact batch record")
            data = fmt.decode_seq(bytes(r.payload), fmt.SeqLimits(
                length=b.length - b.gen_start, vocab=lim.vocab, max_step=lim.max_steps, topk=lim.topk,
                col_lo=b.gen_start, col_hi=b.length))
            if (lim.topk is not None) != (data.topk_ids is not None) or \
                    (lim.capture != "tokens") != (data.confidence is not None):
                raise TraceError(f"sequence record of row {row} does not match capture={lim.capture}")
            old = self._by_row.get(row)
            if old is not None:
                if bytes(old._payload) == bytes(r.payload):
                    raise TraceError(f"the sequence record of row {row} appears twice (the copy is ignored)")
                self._conflicts.add(row)
                raise TraceError(f"row {row} has two different sequence records")
            slot = b.rows.index(row)
            if slot < b.next_slot:      # the recorder writes a batch's rows in order: a reordered file
                if not self._recover:
                    raise TraceError(f"the sequence records of batch {b.index} are out of order")
                self.problems.append(f"corrupt: the sequence record of row {row} at byte {r.offset} is out of order")
            b.next_slot = max(b.next_slot, slot + 1)
            self._by_row[row] = Sequence(self, b, slot, data, r.payload)
        elif k == fmt.BATCH_END:
            meta, c, has_table = records.decode_batch_end_head(r.payload, lim, lim.max_steps)
            table = c if has_table else None
            b = self._batch(meta.get("batch"))
            if b.end is not None:
                raise TraceError(f"batch {b.index} ends twice")
            check_int(meta.get("steps"), "batch-end steps", 0, lim.max_steps)
            check_int(meta.get("nfe"), "batch-end NFE", 0, lim.max_steps << 20)
            check_float(meta.get("wall_time"), "batch-end wall time", 0.0)
            if meta.get("rows") != b.rows:
                raise TraceError(f"batch-end record of batch {b.index} lists other rows than its batch record")
            if table is not None:      # the batch's last step table travels with its totals
                try:
                    tmeta, arrays = self._table(table, b)
                    self._add_steps(b, tmeta, arrays, bytes(r.payload))
                except TraceError:
                    b.steps_lost = True
                    raise
            b.end = meta
        elif k == fmt.LOGITS:
            # only the small index is read here; the logits are decoded on demand (Trace.logits)
            head = fmt.read_bundle_head(r.payload, max_index=SLACK)
            m = head.meta
            b = self._batch(m.get("batch"))
            step = check_int(m.get("step"), "logits step", 0, lim.max_steps)
            check_int(m.get("start"), "logits window start", 0, b.length)
            shape = check_type(m.get("shape"), list, "logits shape")
            if len(shape) != 3:
                raise TraceError("logits shape is not [rows, window, vocabulary]")
            Bq = check_int(shape[0], "logits rows", 1, len(b.rows))
            W = check_int(shape[1], "logits window", 0, b.length)
            V = check_int(shape[2], "logits vocabulary", 1, lim.vocab)
            nb = check_int(m.get("nb"), "logits byte width", 1, 8)
            if head.array_bytes > Bq * W * V * (nb + 12) + SLACK:
                raise TraceError(f"logits record of {head.array_bytes} bytes for a [{Bq}, {W}, {V}] step")
            key = (b.index, step)
            if key in self._logits:
                raise TraceError(f"logits of batch {b.index} step {step} appear twice")
            if sum(1 for bi, _ in self._logits if bi == b.index) >= lim.max_steps:
                raise TraceError(f"batch {b.index} has more than {lim.max_steps} logits records")
            self._logits[key] = (r.payload, head)
        elif k == fmt.END:
            if self.end is not None:
                raise TraceError("a second end record")
            meta = records.decode_end(r.payload, records.time_origin(self.header))
            check_type(meta.get("status"), str, "end record status")
            recs = check_type(meta.get("records"), dict, "end record counts")
            for name, v in recs.items():
                check_int(v, f"end record count of '{name}'", 0, 1 << 40)
            for i in check_type(meta.get("unfinished_batches", []), list, "end record unfinished batches"):
                check_int(i, "end record unfinished batch", 0, MAX_ROWS)
            check_int(meta.get("bytes_before_end"), "end record byte count", 0, 1 << 50)
            check_type(meta.get("sha256_before_end"), str, "end record digest")
            self.end = meta
            self._end_offset = r.offset
        elif k == fmt.HEADER:
            raise TraceError("a second header record")

    def _table(self, c, b: BatchInfo):
        """A step table of batch ``b``: its arrays and text charged against byte budgets of ``n`` steps."""
        B = len(b.rows)
        return records.decode_table(c, B, STEPS_PER_RECORD, self.limits.max_steps,
                                    lambda n: SLACK + n * (STEP_BYTES + STEP_ROW_BYTES * B),
                                    lambda n: SLACK + n * (STEP_JSON + STEP_ROW_JSON * B))

    def _add_steps(self, b: BatchInfo, meta: dict, arrays: dict, payload: bytes) -> None:
        meta["batch"] = b.index
        n = check_steps(meta, arrays, b, self.limits)
        first = int(meta["first"])
        old = b._chunks.get(first)
        if old is not None:
            if old[2] == payload:
                raise TraceError(f"step records of batch {b.index} from step index {first} appear twice "
                                 "(the copy is ignored)")
            b.steps_lost = True
            raise TraceError(f"step records of batch {b.index} from step index {first} appear twice with "
                             "different contents")
        if b.n_steps + n > self.limits.max_steps:
            raise TraceError(f"batch {b.index} has more than {self.limits.max_steps} steps")
        b._chunks[first] = (meta, arrays, payload)
        b.n_steps += n

    def _batch(self, i) -> BatchInfo:
        check_int(i, "batch index", 0, MAX_ROWS)
        if i not in self.batches:
            raise TraceError(f"record refers to unknown batch {i}")
        return self.batches[i]

    def _cross_check(self, recover: bool) -> None:
        """What the records say about each other: steps, rows, record counts and the end digest."""
        for b in sorted(self.batches.values(), key=lambda b: b.index):
            self._check_batch(b, recover)
        for row in sorted(self._conflicts):
            self._problem(f"lost: row {row} (two different intact sequence records)", recover)
        if self._orphans:
            self._problem(f"lost: {_rows(self._orphans)} (their batch record is damaged)", recover)
        if self.end is None:
            if not self.damage:
                self._problem("incomplete: no end record (the run was cut off before the trace was closed)", recover)
            elif not self.damage[-1][2].startswith("truncated"):
                self._problem("lost: the end record (the run's final status is unknown)", recover)
        else:
            self._check_end(recover)
        exp = self.limits.rows
        if exp is not None:
            gone = [r for r in range(exp) if r not in self._by_row]
            if gone:
                self._problem(f"lost: {len(gone)} of {exp} rows have no sequence record (rows {_span(gone)})", recover)
        elif self.status == "complete":
            named = sorted(r for b in self.batches.values() for r in b.rows)
            if named != list(range(len(named))):
                self._problem(f"lost: the batches of a complete run list rows {_span(named)}", recover)

    def _check_batch(self, b: BatchInfo, recover: bool) -> None:
        pos = 0                                       # gaps or overlaps in the step records
        for first in sorted(b._chunks):
            if first != pos:
                b.steps_lost = True
                self._problem(f"lost: step records of batch {b.index} (step indices {pos}..{first - 1})"
                              if first > pos else f"corrupt: step records of batch {b.index} overlap", recover)
            pos = max(pos, first + int(b._chunks[first][0]["n"]))
        missing = [row for row in b.rows if row not in self._by_row]
        if b.end is None:
            b.steps_lost = True     # its last step table went with it: the rows cannot be checked against steps
            if len(missing) == len(b.rows):
                self._problem(f"lost: batch {b.index} (rows {_span(b.rows)}) has {b.n_steps} step records "
                              "but no sequence records", recover)
            elif missing:
                self._problem(f"lost: {_rows(missing)} of batch {b.index} (no intact sequence record; its "
                              "batch-end record is missing too)", recover)
            else:
                self._problem(f"lost: the batch-end record of batch {b.index} (its totals and last step table; "
                              "its rows are intact)", recover)
        else:
            if missing:
                self._problem(f"lost: {_rows(missing)} of batch {b.index} (no intact sequence record)", recover)
            if b.end["steps"] > b.n_steps and not b.steps_lost:
                b.steps_lost = True
                self._problem(f"lost: step records of batch {b.index} (step indices {b.n_steps}.."
                              f"{b.end['steps'] - 1})", recover)
            elif b.end["steps"] < b.n_steps:
                self._problem(f"corrupt: batch {b.index} has {b.n_steps} steps, its batch-end record says "
                              f"{b.end['steps']}", recover)
            elif not b.steps_lost and b.end["nfe"] != sum(int(c[1]["nfe"].sum()) for c in b._chunks.values()):
                self._problem(f"corrupt: the step NFEs of batch {b.index} do not add up to its batch-end "
                              f"record's {b.end['nfe']}", recover)
        if not b.steps_lost:
            self._check_rows(b, recover)

    def _check_rows(self, b: BatchInfo, recover: bool) -> None:
        """A row must agree with its batch's step records (its commit steps, finish step and NFE); a row that
        does not is dropped (and named) rather than returned wrong."""
        tab = b.steps
        last = int(tab.step[-1]) if len(tab) else 0
        total = int(tab.nfe.sum())
        for s in [self._by_row[r] for r in b.rows if r in self._by_row]:
            fin = np.flatnonzero(tab.finished[:, s.slot])
            first = int(tab.step[fin[0]]) if fin.size else -1
            why = None
            if max(s.n_steps, s.finish_step) > last:
                why = f"holds step {max(s.n_steps, s.finish_step)}, after batch {b.index}'s last step {last}"
            elif s.finish_step != first:
                why = f"finished at step {s.finish_step}, its batch's step records say {first}"
            elif s._data.nfe > total:                  # the stored count (``nfe`` is derived from the steps)
                why = f"claims NFE {s._data.nfe}, its batch ran {total} model calls"
            if why:
                self._problem(f"corrupt: row {s.row} {why} (the row is dropped)", recover)
                del self._by_row[s.row]

    def _check_end(self, recover: bool) -> None:
        end, off = self.end, self._end_offset
        if end.get("bytes_before_end") != off:
            self._problem(f"corrupt: the end record says it starts at byte {end.get('bytes_before_end')}, "
                          f"it starts at {off}", recover)
        elif end["sha256_before_end"] != hashlib.sha256(memoryview(self.data)[:off]).hexdigest()[
                :2 * records.DIGEST_BYTES]:
            self._problem("corrupt: records were reordered, removed or replaced (file digest mismatch)", recover)
        counts: Dict[str, int] = {}
        for r in self.records:
            if r.offset < off:
                counts[fmt.KIND_NAMES[r.kind]] = counts.get(fmt.KIND_NAMES[r.kind], 0) + 1
        want = {k: v for k, v in end["records"].items() if v}
        if counts != want:
            diff = ", ".join(f"{k} {counts.get(k, 0)} vs {want.get(k, 0)}" for k in sorted(set(counts) | set(want))
                             if counts.get(k, 0) != want.get(k, 0))
            self._problem(f"corrupt: record counts differ from the end record ({diff})", recover)
        unfinished = sorted(b.index for b in self.batches.values() if b.end is None)
        if sorted(end.get("unfinished_batches") or []) != unfinished and not self.problems:
            self._problem(f"corrupt: the end record lists unfinished batches {end.get('unfinished_batches')}, "
                          f"the file has {unfinished}", recover)

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
        return self.header.get("config") or {}

    @property
    def eos_id(self) -> Optional[int]:
        return (self.header.get("model") or {}).get("eos_id")

    @property
    def capture(self) -> str:
        return self.limits.capture

    @property
    def max_step(self) -> int:
        """The last step any sequence of the file committed or held anything at."""
        return max([s.n_steps for s in self._seqs] + [0])

    def logits(self, batch: int, step: int) -> Tuple[int, np.ndarray]:
        """``(start, logits[B, W, V])`` of a step (capture=logits), decoded within the recorded error bound."""
        key = (int(batch), int(step))
        if key not in self._logits:
            raise KeyError(f"no logits recorded for batch {batch} step {step} (capture={self.capture})")
        payload, head = self._logits[key]
        meta, arrays = fmt.decode_bundle(payload, limit=head.array_bytes, head=head)
        return int(meta["start"]), fmt.dequantize_logits(meta, arrays)

    def logit_steps(self) -> List[Tuple[int, int]]:
        return sorted(self._logits)

    @property
    def tokenizer(self):
        """A decoder with ``decode(ids)`` and ``token(id)``, or None (ids are shown instead of text)."""
        if not self._text_loaded:
            with _TEXT_LOCK:     # (a Trace shared by threads: none may see the flag before the decoder is there)
                if not self._text_loaded:
                    from .text import text_decoder

                    self._text = text_decoder(self.header.get("tokenizer"), self._tokenizer_dir, self.notes)
                    self._text_loaded = True
        return self._text

    def decode_text(self, ids: List[int]) -> str:
        tok = self.tokenizer
        if tok is None:
            return " ".join(str(i) for i in ids)
        return tok.decode(list(ids))

    def totals(self):
        """Aggregates over the sequences read (:func:`dlm_engine.metrics.totals`); ``model_calls`` counts the
        batched forwards of every batch."""
        from dlm_engine.metrics import totals

        calls = sum(int(b.steps.nfe.sum()) for b in self.batches.values())
        return totals((s.metrics for s in self), model_calls=calls)

    def summary(self) -> Dict[str, Any]:
        return {"sequences": len(self), "batches": len(self.batches), "status": self.status,
                "problems": list(self.problems), "bytes": self.size}


def open_trace(path: Union[str, Path], recover: bool = True, tokenizer: Union[str, Path, None] = None) -> Trace:
    """Open a trace file (``NAME.partial`` files of interrupted runs too).

    With ``recover=True`` a damaged or truncated file yields every intact complete row and
    ``trace.problems`` says what was lost; with ``recover=False`` any problem raises :class:`TraceError`.
    ``tokenizer``: a checkpoint directory whose tokenizer turns ids into text (the path recorded in the
    header is never followed on its own); the embedded model's character tokenizer needs none.
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
    except OSError as exc:
        raise TraceError(f"{p}: {exc.strerror or exc}") from None
    return Trace(data, name=str(p), recover=recover, tokenizer=tokenizer)


def loads(data: bytes, name: str = "trace", recover: bool = True, tokenizer=None) -> Trace:
    return Trace(bytes(data), name=name, recover=recover, tokenizer=tokenizer)
