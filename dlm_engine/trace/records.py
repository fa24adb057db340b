"""Binary payloads of the batch, steps, batch-end and end records (``docs/trace_format.md``): varints and
column streams, so a batch of one row and 128 steps costs a few hundred bytes in all (format 1.x wrote them as
zstd-compressed JSON bundles, whose keys, index and frame cost more than the decode they described; 2.x
readers refuse 1.x files).

Decoders return ``(meta, arrays)`` dictionaries (a step table as named arrays: ``wall_dus``, ``nfe``, ...),
which the reader checks. Every decoder reads through a :class:`Cursor`: each count is checked against a
caller-given bound before anything is allocated, every allocation of a step table is charged against the
record's byte budget, and anything malformed raises :class:`TraceError`.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import codecs
from . import format as fmt
from .format import TraceError, get_varint, put_varint

# names that step tables hold as one byte (block event kinds, strategy scalars); any other is spelled out.
# Part of the format: a name may be appended in a later minor version, never removed or moved.
WELL_KNOWN = ("opened", "admitted", "completed", "stored", "block", "committed", "remasked", "block_progress",
              "gap", "exit_threshold", "exit", "threshold", "vocab_size", "prophet_commit", "eos_stop", "infill",
              "constraints")
_KNOWN_INDEX = {k: i for i, k in enumerate(WELL_KNOWN)}

# --------------------------------------------------------------------------------------------------
# a bounded reader of binary payloads


class Cursor:
    """Reads varints, bytes, text and integer streams from ``buf[pos:end]``, never past ``end``.

    ``budget`` (bytes) bounds what the decoded arrays may allocate and ``text`` what strings may hold;
    both are charged *before* a stream is decoded.
    """

    def __init__(self, buf, pos: int = 0, end: Optional[int] = None, budget: int = 1 << 62, text: int = 1 << 62):
        self.buf, self.pos = buf, pos
        self.end = len(buf) if end is None else end
        self.budget, self.text_budget = budget, text

    def left(self) -> int:
        return self.end - self.pos

    def u8(self, what: str = "byte") -> int:
        if self.pos >= self.end:
            raise TraceError(f"record ends inside its {what}")
        v = self.buf[self.pos]
        self.pos += 1
        return v

    def varint(self, what: str, hi: int = 1 << 62) -> int:
        v, pos = get_varint(self.buf, self.pos)
        if pos > self.end:
            raise TraceError(f"record ends inside its {what}")
        self.pos = pos
        return fmt.check_int(v, what, 0, hi)

    def zz(self, what: str, lo: int = -(1 << 61), hi: int = 1 << 61) -> int:
        v, pos = fmt.get_zz(self.buf, self.pos)
        if pos > self.end:
            raise TraceError(f"record ends inside its {what}")
        self.pos = pos
        return fmt.check_int(v, what, lo, hi)

    def raw(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise TraceError(f"record ends inside its {what}")
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def name(self, what: str, max_len: int) -> str:
        code = self.varint(what, len(WELL_KNOWN))
        return WELL_KNOWN[code - 1] if code else self.text(what, max_len)

    def text(self, what: str, max_len: int) -> str:
        n = self.varint(f"{what} length", max_len)
        self.charge_text(n, what)
        try:
            return self.raw(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise TraceError(f"{what} is not UTF-8 text") from None

    def charge(self, nbytes: int, what: str) -> None:
        self.budget -= nbytes
        if self.budget < 0:
            raise TraceError(f"{what} needs more memory than this record may use")

    def charge_text(self, nbytes: int, what: str) -> None:
        self.text_budget -= nbytes
        if self.text_budget < 0:
            raise TraceError(f"{what} holds more text than this record may")

    def ints(self, n: int, what: str) -> np.ndarray:
        self.charge(8 * n, what)
        v, pos = fmt.decode_ints(memoryview(self.buf)[:self.end], self.pos, n)
        self.pos = pos
        return v

    def col(self, n: int, what: str) -> np.ndarray:
        """``n`` values of an integer column (``format.encode_col``); wrapped arithmetic on hostile input, so
        callers range-check."""
        v, self.pos = fmt.decode_col(memoryview(self.buf)[:self.end], self.pos, n, what, self.charge)
        return v

    def done(self, what: str) -> None:
        if self.pos != self.end:
            raise TraceError(f"{what} has {self.end - self.pos} trailing bytes")


def put_text(out: bytearray, s: str) -> None:
    b = s.encode("utf-8")
    put_varint(out, len(b))
    out += b


def put_name(out: bytearray, name: str) -> None:
    """A well-known name as its index + 1, any other as 0 and its text."""
    if name in _KNOWN_INDEX:
        put_varint(out, _KNOWN_INDEX[name] + 1)
    else:
        out.append(0)
        put_text(out, name)


def put_col(out: bytearray, v, level: int = fmt.ZSTD_LEVEL) -> None:
    out += fmt.encode_col(v, level)


def put_rows(out: bytearray, rows: Sequence[int], level: int) -> None:
    put_varint(out, len(rows))
    r = np.asarray(rows, dtype=np.int64)
    put_col(out, np.diff(r, prepend=-1) - 1, level)     # consecutive rows: a constant column of zeros


def get_rows(cur: Cursor, max_rows: int, max_row: int) -> List[int]:
    """Row numbers (``row[i] - row[i-1] - 1`` coded, ``row[-1] = -1``), each in ``0..max_row``."""
    B = cur.varint("row count", max_rows)
    gaps = cur.col(B, "row numbers")
    if B and (int(gaps.min()) < -max_row - 2 or int(gaps.max()) > max_row):
        raise TraceError("batch row out of range")
    rows = np.cumsum(gaps + 1) - 1
    fmt.in_range(rows, 0, max_row, "batch row")
    return [int(x) for x in rows]


# --------------------------------------------------------------------------------------------------
# wall time: per-step durations as small floats (3 mantissa bits: within 1/16 of the measured duration)
WALL_MANTISSA = 3
WALL_MAX_EXP = 40


def wall_code(d: int, mb: int) -> int:
    """The code whose value is nearest ``d`` microseconds (``d >= 0``)."""
    M = 1 << mb
    if d < 2 * M:
        return d
    e = d.bit_length() - mb - 1
    m = d >> e
    if d - (m << e) > ((m + 1) << e) - d:
        m += 1
        if m == 2 * M:
            m, e = M, e + 1
    return min((e + 1) * M + m - M, (WALL_MAX_EXP + 2) * M - 1)


def wall_values(codes: np.ndarray, mb: int) -> np.ndarray:
    """Durations (us) of codes: ``c`` below ``2M``, else ``(M + c mod M) << (c div M - 1)``."""
    M = 1 << mb
    codes = codes.astype(np.int64, copy=False)
    if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= (WALL_MAX_EXP + 2) * M):
        raise TraceError("wall time code out of range")
    e = np.maximum(codes // M - 1, 0)
    return np.where(codes < 2 * M, codes, (M + codes % M) << e)


def quantise_wall(wall_us, prev: int, mb: int = WALL_MANTISSA) -> np.ndarray:
    """Codes of the steps' durations (``wall_us``: decode time after each step, ``prev``: before the first).
    Each duration is rounded on its own, so every step's decoded duration is within 1/16 of the measured one.
    Vectorised :func:`wall_code` (a table is encoded once per batch on the writer thread)."""
    t = np.asarray(wall_us, dtype=np.int64).ravel()
    if not t.size:
        return np.zeros(0, dtype=np.int64)
    before = np.maximum.accumulate(np.concatenate(([int(prev)], t)))[:-1]     # latest time before each step
    d = np.maximum(t - before, 0)
    if int(d.max()) >= 1 << 52:          # beyond float64's exact integers (143 years): the scalar path
        return np.array([wall_code(int(x), mb) for x in d.tolist()], dtype=np.int64)
    M = 1 << mb
    e = np.maximum(np.frexp(d.astype(np.float64))[1].astype(np.int64) - mb - 1, 0)   # bit_length - mb - 1
    m = d >> e
    m = m + (d - (m << e) > ((m + 1) << e) - d)         # to the nearest, a tie down
    carry = m == 2 * M
    m, e = np.where(carry, M, m), e + carry
    return np.where(d < 2 * M, d, np.minimum((e + 1) * M + m - M, (WALL_MAX_EXP + 2) * M - 1))


# --------------------------------------------------------------------------------------------------
# step tables (steps records, and the last chunk of a batch inside its batch-end record)
T_CONSECUTIVE, T_ZSTD = 1, 2
S_BOOL, S_INT, S_F32, S_F64 = 0, 1, 2, 3
MAX_SCALAR_DIMS = 3


def encode_table(meta: Dict[str, Any], arrays: Dict[str, np.ndarray], wall_base: int,
                 level: int = fmt.ZSTD_LEVEL) -> bytes:
    """A step table from what the recorder collected: ``arrays`` holds ``wall_us`` (absolute, us), ``nfe``,
    ``start``, ``width``, ``active``/``finished`` [n, B], ``step``, ``s:NAME`` (+ ``p:NAME``); ``meta`` holds
    ``first``, ``events`` and ``json_scalars``; ``wall_base``: the decode time (us) before its first step, which
    anchors its wall times (each table's times are exact at its start)."""
    n = int(arrays["nfe"].shape[0])
    steps = arrays["step"].astype(np.int64)
    consecutive = n > 0 and bool((steps == steps[0] + np.arange(n)).all())
    sizer = codecs._Sizer()          # every column of the table sized together, then built in order
    parts: List[Any] = []          # bytes as they are, and (int) the handles of columns to build

    def col(v) -> None:
        parts.append(sizer.col(v))

    if not consecutive:
        col(steps)
    codes = quantise_wall(arrays["wall_us"], wall_base)
    head = bytearray((WALL_MANTISSA,))
    put_varint(head, wall_base)
    parts.append(bytes(head))
    col(codes)
    for k in ("nfe", "start", "width"):
        col(arrays[k])
    for k in ("active", "finished"):
        col(np.ascontiguousarray(arrays[k].T))   # row by row: long runs
    names = [k[2:] for k in arrays if k.startswith("s:")]
    head = bytearray()
    put_varint(head, len(names))
    parts.append(bytes(head))
    for name in names:
        a = arrays["s:" + name]
        present = arrays.get("p:" + name)
        head = bytearray()
        put_name(head, name)
        if a.dtype == np.bool_:
            typ, vals = S_BOOL, a.astype(np.int64)
        elif a.dtype.kind in "iu":
            typ, vals = S_INT, a.astype(np.int64)
        else:
            f = a.astype(np.float64)
            if np.array_equal(f.astype(np.float32).astype(np.float64), f, equal_nan=True):
                typ, vals = S_F32, f.astype("<f4").view("<u4").astype(np.int64)
            else:
                typ, vals = S_F64, f.astype("<f8").view("<i8")
        head += bytes((typ, a.ndim - 1))
        for d in a.shape[1:]:
            put_varint(head, d)
        head.append(0 if present is None else 1)
        parts.append(bytes(head))
        if present is not None:
            col(present.astype(np.int64))
            vals = vals[present]
        col(vals)
    sizer.run()
    body = bytearray()
    for x in parts:
        body += fmt.encode_col(None, level, sizer.col_plan(x)) if isinstance(x, int) else x
    events = meta.get("events") or []
    put_varint(body, len(events))
    prev = 0
    for i, kind, block, start, end, row in events:     # few per table: varints, the step index delta-coded
        put_varint(body, i - prev)
        prev = i
        put_name(body, kind)
        for v in (block, start, end, row):
            fmt.put_zz(body, v)
    js = meta.get("json_scalars") or {}
    put_varint(body, len(js))
    if js:
        put_text(body, json.dumps(js, separators=(",", ":"), default=str))
    out = bytearray()
    put_varint(out, int(meta["first"]))
    put_varint(out, n)
    flags = T_CONSECUTIVE if consecutive else 0
    z = fmt.zc(bytes(body), level) if len(body) > 48 else None
    if z is not None and len(z) < len(body):
        flags |= T_ZSTD
        body = z
    out.append(flags)
    if consecutive:
        put_varint(out, int(steps[0]))
    return bytes(out + body)


def decode_table(cur: Cursor, B: int, max_n: int, max_step: int, array_budget, index_budget
                 ) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """A step table of a batch of ``B`` rows, to the end of the cursor, as ``(meta, arrays)``.

    ``array_budget(n)`` / ``index_budget(n)``: the bytes its arrays / its text may take for ``n`` steps."""
    first = cur.varint("steps record start", max_step)
    n = cur.varint("steps record size", max_n)
    if n < 1:
        raise TraceError("steps record holds no steps")
    flags = cur.u8("steps record flags")
    if flags & ~(T_CONSECUTIVE | T_ZSTD):
        raise TraceError(f"steps record has unknown flags {flags}")
    meta: Dict[str, Any] = {"first": first, "n": n}
    if flags & T_CONSECUTIVE:
        meta["step0"] = cur.varint("steps record step0", max_step)
    abytes, ibytes = array_budget(n), index_budget(n)
    if flags & T_ZSTD:
        body = fmt.zd(cur.raw(cur.left(), "step table"), limit=abytes + ibytes)
        c = Cursor(body, 0, None, abytes, ibytes)
    else:
        c = Cursor(cur.buf, cur.pos, cur.end, abytes, ibytes)
        cur.pos = cur.end
    arrays: Dict[str, np.ndarray] = {}
    if not flags & T_CONSECUTIVE:
        arrays["step"] = _bounded(c.col(n, "step numbers"), 0, max_step, "step number").astype(np.int32)
    mb = c.u8("wall time precision")
    if not 1 <= mb <= 8:
        raise TraceError(f"steps record has a wall time precision of {mb} bits")
    base = meta["wall_base"] = c.varint("wall time base", 1 << 50)
    with np.errstate(over="ignore"):
        rec = base + np.cumsum(wall_values(c.col(n, "wall times"), mb))
    arrays["wall_dus"] = np.diff(rec, prepend=0).astype(np.int64)
    for k in ("nfe", "start", "width"):
        arrays[k] = _bounded(c.col(n, k), 0, (1 << 31) - 1, k).astype(np.int32)
    for k in ("active", "finished"):
        arrays[k] = np.ascontiguousarray(_bools(c.col(n * B, k), k).reshape(B, n).T)
    json_scalars: Dict[str, Any] = {}
    for _ in range(c.varint("scalar count", c.left())):     # each takes >= 4 bytes
        name = c.name("scalar name", 128)
        if "s:" + name in arrays or name in json_scalars:
            raise TraceError(f"scalar '{name[:40]}' appears twice")
        typ = c.u8("scalar type")
        if typ > S_F64:
            raise TraceError(f"scalar '{name[:40]}' has unknown type {typ}")
        ndim = c.u8("scalar dimensions")
        if ndim > MAX_SCALAR_DIMS:
            raise TraceError(f"scalar '{name[:40]}' has {ndim} dimensions")
        dims = tuple(c.varint("scalar dimension", 1 << 32) for _ in range(ndim))
        per = int(np.prod(dims, dtype=object)) if dims else 1
        c.charge(8 * n * per, f"scalar '{name[:40]}'")
        present = None
        has_p = c.u8("scalar presence")
        if has_p > 1:
            raise TraceError(f"scalar '{name[:40]}' has a bad presence flag")
        if has_p:
            present = _bools(c.col(n, "scalar presence"), "scalar presence")
        k = int(present.sum()) if present is not None else n
        vals = c.col(k * per, f"scalar '{name[:40]}'")
        if typ == S_BOOL:
            vals, dt = _bools(vals, f"scalar '{name[:40]}'"), np.bool_
        elif typ == S_INT:
            dt = np.int64
        else:
            if typ == S_F32:
                if k * per and (int(vals.min()) < 0 or int(vals.max()) >= 1 << 32):
                    raise TraceError(f"scalar '{name[:40]}' has a bad float32 value")
                vals = vals.astype("<u4").view("<f4").astype(np.float64)
            else:
                vals = vals.astype("<i8").view("<f8")
            dt = np.float64
        full = np.zeros((n,) + dims, dtype=dt)
        if present is None:
            full[...] = vals.reshape((n,) + dims)
        else:
            full[present] = vals.reshape((k,) + dims)
            if not present.all():
                arrays["p:" + name] = present
        arrays["s:" + name] = full
    E = c.varint("block event count", c.left())      # each takes >= 6 bytes
    c.charge_text(64 * E, "block events")
    events, i = [], 0
    for _ in range(E):
        i += c.varint("block event step index", n)
        events.append([i, c.name("block event kind", 32)] + [c.zz("block event field") for _ in range(4)])
    meta["events"] = events
    n_js = c.varint("JSON scalar count", c.left())
    if n_js:
        js = fmt.load_json(c.text("JSON scalars", fmt.MAX_JSON).encode(), "steps record scalars")
        if not isinstance(js, dict) or len(js) != n_js:
            raise TraceError(f"steps record scalars are not a JSON object of {n_js} scalars")
        for k in js:
            if "s:" + k in arrays:
                raise TraceError(f"scalar '{k[:40]}' appears twice")
        json_scalars = js
    meta["json_scalars"] = json_scalars
    c.done("step table")
    return meta, arrays


def _bounded(v: np.ndarray, lo: int, hi: int, what: str) -> np.ndarray:
    fmt.in_range(v, lo, hi, what)
    return v


def _bools(v: np.ndarray, what: str) -> np.ndarray:
    if v.size and (int(v.min()) < 0 or int(v.max()) > 1):
        raise TraceError(f"{what} holds a value other than 0 and 1")
    return v.astype(np.bool_)


# --------------------------------------------------------------------------------------------------
# batch record: who is decoded, from which prompts
B_RNG, B_INFO = 1, 2


def batch_defaults(header: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[bytes]]:
    """What a 2.x batch record leaves out when its batch has the same: the batch info (the strategy the
    header's config names) and the fingerprint of the generator state (the state the header recorded)."""
    cfg = header.get("config") if isinstance(header.get("config"), dict) else {}
    strategy = cfg.get("strategy") if isinstance(cfg.get("strategy"), dict) else {}
    info = {"strategy": strategy["name"]} if isinstance(strategy.get("name"), str) else {}
    rng = header.get("rng") if isinstance(header.get("rng"), dict) else {}
    if "fingerprint" in rng:        # 2.1: written (the CPU state itself may be left out: torch_cpu_seed)
        fp = rng["fingerprint"]
        return info, (bytes.fromhex(fp) if isinstance(fp, str) and re.fullmatch(r"[0-9a-f]{16}", fp) else None)
    try:
        state = b"".join(base64.b64decode(rng[k], validate=True) for k in ("torch_cpu_b64", "torch_cuda_b64")
                         if isinstance(rng.get(k), str))
    except (ValueError, TypeError):
        state = b""
    return info, (rng_fingerprint(state) if state else None)


def rng_fingerprint(state: bytes) -> bytes:
    """8 bytes that tell generator states apart: the first 8 bytes of their SHA-256."""
    return hashlib.sha256(state).digest()[:8]


def encode_batch(meta: Dict[str, Any], prompt_tokens: np.ndarray, prompt_mask: np.ndarray, fp: Optional[bytes],
                 defaults: Tuple[Dict[str, Any], Optional[bytes]], level: int = fmt.ZSTD_LEVEL) -> bytes:
    """``fp``: :func:`rng_fingerprint` of the generator state at the batch's start; ``defaults``:
    :func:`batch_defaults`."""
    out = bytearray()
    put_varint(out, meta["batch"])
    put_rows(out, meta["rows"], level)
    P = int(meta["gen_start"])
    for v in (P, int(meta["length"]) - P, meta["mask_id"]):
        put_varint(out, v)
    info = meta.get("info") or {}
    flags = (B_RNG if fp is not None and fp != defaults[1] else 0) | (B_INFO if info != defaults[0] else 0)
    out.append(flags)
    if flags & B_RNG:
        out += fp
    if flags & B_INFO:
        put_text(out, json.dumps(info, separators=(",", ":"), default=str))
    if P:
        out += fmt.encode_ints(prompt_tokens.astype(np.int64).ravel(), level)
        out += fmt.encode_col(prompt_mask.astype(np.int64).ravel(), level)    # left padding: one or two runs
    return bytes(out)


def decode_batch(buf, lim, defaults: Tuple[Dict[str, Any], Optional[bytes]], slack: int
                 ) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """``lim``: the reader's ``Limits``; every size is checked against it before the prompt is decoded."""
    c = Cursor(buf, text=slack)
    meta: Dict[str, Any] = {"batch": c.varint("batch index", 1 << 24)}
    meta["rows"] = rows = get_rows(c, lim.batch, lim.max_rows - 1)
    P = meta["gen_start"] = c.varint("batch gen_start", lim.prompt)
    meta["length"] = P + c.varint("batch generated positions", lim.gen)
    meta["mask_id"] = c.varint("batch mask_id", lim.vocab - 1)
    if len(rows) * meta["length"] > lim.positions:
        raise TraceError(f"batch of {len(rows)} x {meta['length']} positions exceeds the {lim.positions} "
                         "the header allows")
    flags = c.u8("batch flags")
    if flags & ~(B_RNG | B_INFO):
        raise TraceError(f"batch record has unknown flags {flags}")
    fp = c.raw(8, "RNG fingerprint") if flags & B_RNG else defaults[1]
    meta["rng_sha256"] = fp.hex() if fp is not None else None     # (2.x: the first 8 bytes of the SHA-256)
    info = dict(defaults[0])
    if flags & B_INFO:
        extra = fmt.load_json(c.text("batch info", slack).encode(), "batch info")
        info = fmt.check_type(extra, dict, "batch info")
    meta["info"] = info
    B = len(rows)
    if P:
        tok = c.ints(B * P, "prompt")
        mask = c.col(B * P, "prompt mask")
        arrays = {"prompt_tokens": tok.reshape(B, P), "prompt_mask": _bools(mask, "prompt mask").reshape(B, P)}
    else:
        arrays = {"prompt_tokens": np.zeros((B, 0), np.int64), "prompt_mask": np.zeros((B, 0), np.bool_)}
    c.done("batch record")
    return meta, arrays


# --------------------------------------------------------------------------------------------------
# batch-end record: the batch's totals and (usually) its last step table
E_MISMATCH, E_TABLE = 1, 2


def encode_batch_end(meta: Dict[str, Any], table: Optional[bytes], level: int = fmt.ZSTD_LEVEL) -> bytes:
    out = bytearray()
    for v in (meta["batch"], meta["steps"], meta["nfe"], round(meta["wall_time"] * 1e6)):
        put_varint(out, v)
    out.append((E_MISMATCH if meta["mismatch"] else 0) | (E_TABLE if table is not None else 0))
    put_rows(out, meta["rows"], level)
    return bytes(out) + (table or b"")


def decode_batch_end_head(buf, lim, max_steps: int) -> Tuple[Dict[str, Any], Cursor, bool]:
    """Totals of a batch-end record, and a cursor on its step table (when it has one)."""
    c = Cursor(buf)
    meta: Dict[str, Any] = {"batch": c.varint("batch index", 1 << 24)}
    meta["steps"] = c.varint("batch-end steps", max_steps)
    meta["nfe"] = c.varint("batch-end NFE", max_steps << 20)
    meta["wall_time"] = c.varint("batch-end wall time", 1 << 50) / 1e6
    flags = c.u8("batch-end flags")
    if flags & ~(E_MISMATCH | E_TABLE):
        raise TraceError(f"batch-end record has unknown flags {flags}")
    meta["mismatch"] = bool(flags & E_MISMATCH)
    meta["rows"] = get_rows(c, lim.batch, lim.max_rows - 1)
    if not flags & E_TABLE:
        c.done("batch-end record")
    return meta, c, bool(flags & E_TABLE)


# --------------------------------------------------------------------------------------------------
# end record: how the run ended, what the file holds, and the digest of every byte before it
STATUS_CODES = {"complete": 0, "interrupted": 1}
DIGEST_BYTES = 16       # the first 16 bytes of the SHA-256 of every byte before the end record
MAX_STATUS = 4096


def encode_end(meta: Dict[str, Any], kinds: Dict[str, int]) -> bytes:
    out = bytearray()
    code = STATUS_CODES.get(meta["status"])
    if code is None:
        out.append(2)
        put_text(out, meta["status"][:MAX_STATUS])
    else:
        out.append(code)
    counts = [(kinds[k], v) for k, v in meta["records"].items() if v]
    put_varint(out, len(counts))
    for kind, v in counts:
        out.append(kind)
        put_varint(out, v)
    put_varint(out, len(meta["unfinished_batches"]))
    for b in meta["unfinished_batches"]:
        put_varint(out, b)
    out += bytes.fromhex(meta["sha256_before_end"])[:DIGEST_BYTES]
    for v in (meta["bytes_before_end"], meta["queue"]["blocked_puts"], meta["finished_after"]):
        put_varint(out, v)
    return bytes(out)


def time_origin(header: Dict[str, Any]) -> int:
    """The whole second the header says the run started (0 without one): end times are counted from it."""
    t = header.get("created_unix")
    return int(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < (1 << 40) else 0


def decode_end(buf, origin: int = 0) -> Dict[str, Any]:
    """``origin``: :func:`time_origin` of the file's header."""
    c = Cursor(buf)
    code = c.u8("end status")
    names = {v: k for k, v in STATUS_CODES.items()}
    if code == 2:
        status = c.text("end status", MAX_STATUS)
    elif code in names:
        status = names[code]
    else:
        raise TraceError(f"end record has unknown status code {code}")
    records = {}
    for _ in range(c.varint("end record count", len(fmt.KIND_NAMES))):
        kind = c.u8("end record kind")
        if kind not in fmt.KIND_NAMES or fmt.KIND_NAMES[kind] in records:
            raise TraceError(f"end record counts an unknown or repeated kind {kind}")
        records[fmt.KIND_NAMES[kind]] = c.varint("end record count", 1 << 40)
    unfinished = [c.varint("end record unfinished batch", 1 << 24)
                  for _ in range(c.varint("end record unfinished batches", 1 << 24))]
    sha = c.raw(DIGEST_BYTES, "end digest").hex()
    size = c.varint("end record byte count", 1 << 50)
    queue = {"blocked_puts": c.varint("queue waits", 1 << 50)}
    after = c.varint("end time", 1 << 40)
    c.done("end record")
    return {"status": status, "records": records, "unfinished_batches": unfinished, "sha256_before_end": sha,
            "bytes_before_end": size, "queue": queue, "finished_after": after,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(origin + after))}
