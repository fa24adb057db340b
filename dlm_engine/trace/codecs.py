"""Value codecs of the trace format (``docs/trace_format.md``, *Primitives*): integer streams (byte planes,
zstd byte planes, bit packing, Rice coding: the smallest by computed size), integer columns (constant, a few
runs, runs, plain, delta), float16/float32 bit streams, and the error-bounded logit quantisation of
``capture=logits``. Every decoder checks sizes against its record before allocating."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .framing import TraceError, ZSTD_LEVEL, check_float, check_int, check_type, get_varint, put_varint, zc, zd

__all__ = [
    "zigzag", "unzigzag", "delta0", "nbytes_for", "planes", "unplanes", "bitpack", "bitunpack", "M_PLANES",
    "M_ZPLANES", "M_BITS", "M_RICE", "RICE_QMAX", "RICE_KMAX", "encode_ints", "decode_ints", "C_CONST", "C_RUNS",
    "C_PLAIN", "C_DELTA", "C_FEW", "FEW_RUNS", "put_zz", "get_zz", "encode_col", "decode_col", "encode_f16",
    "decode_f16", "encode_f32", "decode_f32", "quantize_logits", "dequant", "dequantize_logits",
]

# --------------------------------------------------------------------------------------------------
# integer streams: byte planes (optionally zstd) or bit packing, whichever is smaller
def zigzag(d: np.ndarray) -> np.ndarray:
    d = d.astype(np.int64)
    return ((d << 1) ^ (d >> 63)).astype(np.uint64)


def unzigzag(z: np.ndarray) -> np.ndarray:
    if z.dtype != np.int64:
        z = z.astype(np.int64)
    return (z >> 1) ^ -(z & 1)


def delta0(x: np.ndarray) -> np.ndarray:
    """``x[i] - x[i-1]`` with ``x[-1] = 0`` (np.diff with prepend=0, without its overhead)."""
    x = x.astype(np.int64, copy=False)
    d = np.empty_like(x)
    if x.size:
        d[0] = x[0]
        np.subtract(x[1:], x[:-1], out=d[1:])
    return d


def nbytes_for(vmax: int) -> int:
    return max(1, (int(vmax).bit_length() + 7) // 8)


def planes(v: np.ndarray, nb: int) -> bytes:
    """Plane-major little-endian bytes of non-negative ints: all low bytes, then all next bytes, ..."""
    b = v.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :nb]
    return np.ascontiguousarray(b.T).tobytes()


def unplanes(buf, n: int, nb: int, offset: int = 0) -> np.ndarray:
    b = np.frombuffer(buf, dtype=np.uint8, count=n * nb, offset=offset).reshape(nb, n)
    if nb == 1:
        return b[0].astype(np.int64)
    out = np.zeros((n, 8), dtype=np.uint8)
    out[:, :nb] = b.T
    return out.view("<i8").reshape(n)


def bitpack(v: np.ndarray, width: int) -> bytes:
    if width == 0 or v.size == 0:
        return b""
    b8 = np.ascontiguousarray(v, dtype="<u8").view(np.uint8).reshape(-1, 8)
    bits = np.unpackbits(b8, axis=1, bitorder="little")[:, :width]
    return np.packbits(bits, bitorder="little").tobytes()


_UINT = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def bitunpack(buf, n: int, width: int, offset: int = 0) -> np.ndarray:
    if width == 0 or n == 0:
        return np.zeros(n, dtype=np.int64)
    nbytes = (n * width + 7) // 8
    raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset)
    bits = np.unpackbits(raw, count=n * width, bitorder="little").reshape(n, width)
    packed = np.packbits(bits, axis=1, bitorder="little")      # rows padded to whole bytes
    nb = packed.shape[1]
    if nb not in _UINT:
        wide = np.zeros((n, 8), dtype=np.uint8)
        wide[:, :nb] = packed
        packed, nb = wide, 8
    return packed.view(_UINT[nb]).reshape(n).astype(np.int64)


# stream methods
M_PLANES, M_ZPLANES, M_BITS, M_RICE = 0, 1, 2, 3
RICE_QMAX = 15          # a Rice quotient of 15 or more is an escape: the value is stored whole
RICE_KMAX = 56          # the largest Rice parameter a reader accepts (so the writer tries Rice below 57 bits)


def _rice_best(v: np.ndarray, width: int) -> Tuple[int, int]:
    """``(bytes, k)`` of the smallest Rice code of ``v`` (non-negative int64) for ``k`` next to the usual
    optimum ``log2(mean)`` (three candidates, sized at once, none built; the first smallest wins a tie)."""
    n = v.size
    k0 = max(int(np.log2(max(float(np.add.reduce(v, dtype=np.float64)) / n, 1.0))), 0)   # (== v.mean())
    lo, hi = max(0, k0 - 1), min(k0 + 1, width)
    q = np.minimum(v[None, :] >> np.arange(lo, hi + 1, dtype=np.int64)[:, None], RICE_QMAX)
    best = None
    for k, u, e in zip(range(lo, hi + 1), q.sum(1).tolist(), (q == RICE_QMAX).sum(1).tolist()):
        size = 1 + (u + n + 7) // 8 + (n * k + 7) // 8 + (e * width + 7) // 8   # w:u8 unary rem exc
        if best is None or size < best[0]:
            best = (size, k)
    return best


def _rice(v: np.ndarray, k: int) -> bytes:
    """Rice code with parameter ``k``: ``w:u8 unary rem exc`` (see ``docs/trace_format.md``)."""
    q = v >> k
    esc = q >= RICE_QMAX
    ends = np.cumsum(np.minimum(q, RICE_QMAX) + 1) - 1      # where each value's terminating 0 bit is
    bits = np.ones(int(ends[-1]) + 1 if v.size else 0, dtype=np.uint8)
    bits[ends] = 0
    ev = v[esc]
    w = int(ev.max()).bit_length() if ev.size else 0
    return bytes((w,)) + np.packbits(bits, bitorder="little").tobytes() + bitpack(v & ((1 << k) - 1), k) \
        + bitpack(ev, w)


def _unrice(buf, pos: int, ln: int, n: int, k: int) -> np.ndarray:
    """Decode ``n`` Rice-coded values from ``buf[pos:pos + ln]``; the unary part is scanned in chunks, so
    nothing larger than the ``n`` values is allocated whatever the stream claims."""
    if k > RICE_KMAX or ln < 1:
        raise TraceError("integer stream has a bad Rice parameter")
    end = pos + ln
    w = buf[pos]
    pos += 1
    if w > 63:
        raise TraceError("integer stream has a bad escape width")
    avail = min(end - pos, (n * (RICE_QMAX + 1) + 7) // 8)
    found, off, parts, chunk = 0, 0, [], 1 << 15
    while found < n:
        if off >= avail:
            raise TraceError("integer stream is cut short")
        c = np.unpackbits(np.frombuffer(buf, dtype=np.uint8, count=min(chunk, avail - off), offset=pos + off),
                          bitorder="little")
        z = np.flatnonzero(c == 0)[:n - found]
        parts.append(z + 8 * off if off else z)
        found += z.size
        off += chunk
    ends = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    q = np.diff(ends, prepend=-1) - 1
    if n and int(q.max()) > RICE_QMAX:
        raise TraceError("integer stream has an over-long Rice quotient")
    ub = (int(ends[-1]) + 8) // 8 if n else 0
    esc = q == RICE_QMAX
    ne = int(esc.sum())
    if 1 + ub + (n * k + 7) // 8 + (ne * w + 7) // 8 != ln:
        raise TraceError("integer stream has the wrong size")
    v = (q << k) | bitunpack(buf, n, k, pos + ub)
    if ne:
        ev = bitunpack(buf, ne, w, pos + ub + (n * k + 7) // 8)
        if int((ev >> k).min()) < RICE_QMAX:
            raise TraceError("integer stream has a bad Rice escape")
        v[esc] = ev
    return v


def _ints_plan(v: np.ndarray) -> Tuple[int, int, int, np.ndarray, int]:
    """``(data bytes, method, param, values, byte width)`` of the smallest of byte planes, bit packing and Rice
    coding of ``v`` (non-negative), computed without building any (zstd is left to :func:`encode_ints`, which
    takes the plan so that nothing is sized twice)."""
    v = np.asarray(v)
    v = v if v.dtype == np.uint64 else v.astype(np.int64, copy=False)
    n = v.size
    best, nb, width = _unary_best(n, int(v.max()) if n else 0)
    if n >= 8 and width <= RICE_KMAX:
        v = v.astype(np.int64, copy=False)       # (values below 2^56)
        size, k = _rice_best(v, width)
        best = min(best, (size, M_RICE, k))
    return best + (v, nb)


def _unary_best(n: int, vmax: int) -> Tuple[Tuple[int, int, int], int, int]:
    """``((bytes, method, param), byte width, bit width)`` of the smaller of byte planes and bit packing for ``n``
    values up to ``vmax`` (both sized from the maximum alone; Rice needs the values)."""
    nb = nbytes_for(vmax)
    width = vmax.bit_length()
    best = (n * nb, M_PLANES, nb)
    if width <= 63:
        best = min(best, ((n * width + 7) // 8, M_BITS, width))
    return best, nb, width


def _plan_size(plan) -> int:
    """About the bytes :func:`encode_ints` takes for a plan (exact unless zstd would win)."""
    size = plan[0]
    return size + 2 + (1 if size < 128 else 2 if size < 16384 else 4)


def _plans(arrays: List[np.ndarray]) -> List[Tuple[int, int, int, np.ndarray, int]]:
    """``[_ints_plan(v) for v in arrays]``, the arrays sized together: about twenty numpy calls whatever their
    number, instead of about ten each (a sequence record sizes ~20 candidate streams, a batch's records eight
    times that). The same plans bit for bit: the maxima and Rice sums are per-segment reductions of one
    concatenation, and the Rice parameter's starting point ``log2(mean)`` is taken in exact integer arithmetic
    where that is provably what the float expression of :func:`_rice_best` gives (elsewhere it is that
    function)."""
    vs, ns = [], []
    for a in arrays:
        v = np.asarray(a)
        v = v if v.dtype == np.uint64 else v.astype(np.int64, copy=False)
        vs.append(v)
        ns.append(v.size)
    live = [i for i, n in enumerate(ns) if n]
    vmax = [0] * len(vs)
    flat = starts = None
    if live:
        flat = np.concatenate([vs[i].reshape(-1).view(np.uint64) for i in live])   # (values are non-negative)
        starts = np.cumsum([0] + [ns[i] for i in live[:-1]])
        for i, m in zip(live, np.maximum.reduceat(flat, starts).tolist()):
            vmax[i] = m
    best, nbs, widths, rice = [], [], [], []
    for i, n in enumerate(ns):
        b, nb, width = _unary_best(n, vmax[i])
        best.append(b)
        nbs.append(nb)
        widths.append(width)
        if n >= 8 and width <= RICE_KMAX:
            rice.append(i)
    # exact integer log2 where n * 2^width < 2^46: the float sum is then exact and log2 of the float mean
    # cannot round across an integer (see the docstring); the rest (huge streams of wide values) one by one
    fast = [i for i in rice if (ns[i] << widths[i]) < (1 << 46)]
    for i in rice:
        if (ns[i] << widths[i]) >= (1 << 46):
            size, k = _rice_best(vs[i].astype(np.int64, copy=False), widths[i])
            best[i] = min(best[i], (size, M_RICE, k))
    if fast:
        if len(fast) == len(live):
            sub, rst = flat, starts
        else:
            sub = np.concatenate([vs[i].reshape(-1).view(np.uint64) for i in fast])
            rst = np.cumsum([0] + [ns[i] for i in fast[:-1]])
        lo, nk = [], []
        for i, total in zip(fast, np.add.reduceat(sub, rst).tolist()):
            q = total // ns[i]
            k0 = q.bit_length() - 1 if q >= 1 else 0           # == int(log2(max(mean, 1)))
            lo.append(max(0, k0 - 1))
            nk.append(min(k0 + 1, widths[i]) - lo[-1] + 1)
        base = np.repeat(np.array(lo, dtype=np.uint64), [ns[i] for i in fast])
        sums = []
        for j in range(max(nk)):
            q = np.minimum(sub >> (base + np.uint64(j)), np.uint64(RICE_QMAX))
            sums.append((np.add.reduceat(q, rst).tolist(),
                         np.add.reduceat(q == RICE_QMAX, rst, dtype=np.int64).tolist()))
        for x, i in enumerate(fast):
            n, width, r = ns[i], widths[i], None
            for j in range(nk[x]):
                k, u, e = lo[x] + j, sums[j][0][x], sums[j][1][x]
                size = 1 + (u + n + 7) // 8 + (n * k + 7) // 8 + (e * width + 7) // 8
                if r is None or size < r[0]:
                    r = (size, k)
            best[i] = min(best[i], (r[0], M_RICE, r[1]))
    return [b + (v, nb) for b, v, nb in zip(best, vs, nbs)]


class _Sizer:
    """Integer streams and columns to be sized together (:func:`_plans`): register them (``ints`` / ``col``
    return a handle), call :meth:`run` once, then read their plans (``plan`` / ``col_plan``) -- the same plans
    :func:`_ints_plan` and :func:`_col_plan` give one by one."""

    def __init__(self):
        self.arrays: List[np.ndarray] = []
        self.cols: List[tuple] = []

    def ints(self, v) -> int:
        self.arrays.append(v)
        return len(self.arrays) - 1

    def col(self, v) -> int:
        v, d, starts, plan = _col_prep(v)
        if plan is not None:
            self.cols.append((plan,))
        else:
            self.cols.append((None, v, starts, [self.ints(x) for x in _col_streams(v, d, starts)]))
        return len(self.cols) - 1

    def run(self) -> "_Sizer":
        self.plans = _plans(self.arrays)
        return self

    def plan(self, h: int):
        return self.plans[h]

    def col_plan(self, h: int):
        c = self.cols[h]
        if c[0] is not None:
            return c[0]
        return _col_choice(c[1], c[2], [self.plans[x] for x in c[3]])


def encode_ints(v: np.ndarray, level: int = ZSTD_LEVEL, plan=None) -> bytes:
    """Smallest of raw byte planes, zstd byte planes, bit packing and Rice coding:
    ``method:u8 param:u8 len:varint data``. Sizes are computed first and only the smallest is built; zstd is
    tried when the others leave more than a frame's overhead to gain. ``plan``: ``_ints_plan(v)`` if known."""
    size, m, param, v, nb = plan if plan is not None else _ints_plan(v)
    data = None
    if size > 32 and v.size * nb > 24:
        z = zc(planes(v, nb), level)
        if len(z) < size:
            m, param, data = M_ZPLANES, nb, z
    if data is None:
        data = planes(v, nb) if m == M_PLANES else bitpack(v, param) if m == M_BITS else _rice(v, param)
    out = bytearray((m, param))
    put_varint(out, len(data))
    return bytes(out) + data


def decode_ints(buf, pos: int, n: int) -> Tuple[np.ndarray, int]:
    if pos + 2 > len(buf):
        raise TraceError("record ends inside an integer stream")
    m, param = buf[pos], buf[pos + 1]
    ln, pos = get_varint(buf, pos + 2)
    if pos + ln > len(buf):
        raise TraceError("integer stream runs past the record")
    if m in (M_PLANES, M_ZPLANES) and not 1 <= param <= 8:
        raise TraceError("integer stream has a bad byte width")
    if m == M_PLANES:
        if ln != n * param:
            raise TraceError("integer stream has the wrong size")
        v = unplanes(buf, n, param, pos)
    elif m == M_ZPLANES:
        raw = zd(bytes(buf[pos:pos + ln]), limit=n * param, expect=n * param)
        v = unplanes(raw, n, param)
    elif m == M_BITS:
        if param > 63 or ln != (n * param + 7) // 8:
            raise TraceError("integer stream has the wrong size")
        v = bitunpack(buf, n, param, pos)
    elif m == M_RICE:
        v = _unrice(buf, pos, ln, n, param)
    else:
        raise TraceError(f"unknown integer stream method {m}")
    return v, pos + ln


# --------------------------------------------------------------------------------------------------
# integer columns (any sign): constant, a few runs, runs, plain or delta-coded, whichever is smallest
C_CONST, C_RUNS, C_PLAIN, C_DELTA, C_FEW = 0, 1, 2, 3, 4
FEW_RUNS = 8


def put_zz(out: bytearray, v: int) -> None:
    v = int(v)
    put_varint(out, (v << 1) if v >= 0 else ((-v) << 1) - 1)


def get_zz(buf, pos: int) -> Tuple[int, int]:
    v, pos = get_varint(buf, pos)
    return (v >> 1) ^ -(v & 1), pos


def _col_prep(v) -> Tuple[np.ndarray, np.ndarray, np.ndarray, Optional[tuple]]:
    """``(values, deltas, run starts, plan)`` of a column: ``plan`` is final for a constant column and one of a
    few runs (nothing to size), else None (:func:`_col_choice` picks among the sized codings)."""
    v = np.asarray(v).astype(np.int64, copy=False).ravel()
    if v.size == 0:
        return v, v, v, (2, C_CONST, v, None)
    d = v[1:] - v[:-1]
    starts = np.flatnonzero(d)
    if not starts.size:
        return v, d, starts, (2, C_CONST, v, None)
    starts = np.concatenate(([0], starts + 1))
    if starts.size <= FEW_RUNS:            # a few runs: (value, length - 1) pairs as varints
        return v, d, starts, (2 + 3 * starts.size, C_FEW, v, starts)
    return v, d, starts, None


def _col_streams(v: np.ndarray, d: np.ndarray, starts: np.ndarray) -> List[np.ndarray]:
    """The integer streams a column's codings are sized by: plain, delta, and (when runs are long enough to pay)
    run values and run lengths."""
    out = [zigzag(v), zigzag(d)]
    if starts.size < v.size // 2:
        out += [zigzag(v[starts]), np.diff(np.append(starts, v.size)) - 1]
    return out


def _col_choice(v: np.ndarray, starts: np.ndarray, plans: List[tuple]) -> Tuple[int, int, np.ndarray, Any]:
    """The smallest column coding, from the plans of :func:`_col_streams`'s streams."""
    plain, delta = plans[0], plans[1]
    cands = [(_plan_size(plain), C_PLAIN, v, plain), (_plan_size(delta) + 9, C_DELTA, v, delta)]
    if len(plans) > 2:
        vals, lens = plans[2], plans[3]
        cands.append((_plan_size(vals) + _plan_size(lens) + 3, C_RUNS, v, (starts, vals, lens)))
    return min(cands, key=lambda c: c[0])


def _col_plan(v) -> Tuple[int, int, np.ndarray, Any]:
    """``(about the bytes, method, values, extra)`` of the smallest column coding of ``v``, nothing built;
    ``extra`` carries what :func:`encode_col` needs (run starts, the integer streams' plans)."""
    v, d, starts, plan = _col_prep(v)
    if plan is not None:
        return plan
    return _col_choice(v, starts, [_ints_plan(x) for x in _col_streams(v, d, starts)])


def encode_col(v, level: int = ZSTD_LEVEL, plan=None) -> bytes:
    """``method:u8`` and the data of a column of int64 values (the smallest method by computed size).
    ``plan``: ``_col_plan(v)`` if known."""
    _, m, v, extra = plan if plan is not None else _col_plan(v)
    out = bytearray((m,))
    if m == C_CONST:
        put_zz(out, int(v[0]) if v.size else 0)
    elif m == C_FEW:
        lens = np.diff(np.append(extra, v.size))
        put_varint(out, extra.size)
        for x, ln in zip(v[extra].tolist(), lens.tolist()):
            put_zz(out, x)
            put_varint(out, ln - 1)
    elif m == C_PLAIN:
        out += encode_ints(None, level, extra)
    elif m == C_DELTA:
        put_zz(out, int(v[0]))
        out += encode_ints(None, level, extra)
    else:
        starts, vals, lens = extra
        put_varint(out, starts.size)
        out += encode_ints(None, level, vals) + encode_ints(None, level, lens)
    return bytes(out)


def decode_col(buf, pos: int, n: int, what: str = "column", charge=None) -> Tuple[np.ndarray, int]:
    """``n`` int64 values of a column. ``charge(nbytes, what)`` is called before each allocation (a caller's
    memory budget); run counts are bounded by ``n``. Arithmetic wraps on hostile input: callers range-check."""
    charge = charge or (lambda nbytes, w: None)
    if pos >= len(buf):
        raise TraceError(f"record ends inside its {what}")
    m = buf[pos]
    pos += 1
    if m == C_CONST:
        v0, pos = get_zz(buf, pos)
        check_int(v0, what, -(1 << 63), (1 << 63) - 1)
        charge(8 * n, what)
        return np.full(n, v0, dtype=np.int64), pos
    if m in (C_RUNS, C_FEW):
        r, pos = get_varint(buf, pos)
        if r > (n if m == C_RUNS else min(n, FEW_RUNS)) or (n and not r):
            raise TraceError(f"{what} has {r} runs for {n} values")
        if m == C_FEW:
            vals, lens = [], []
            for _ in range(r):
                x, pos = get_zz(buf, pos)
                ln, pos = get_varint(buf, pos)
                vals.append(check_int(x, what, -(1 << 63), (1 << 63) - 1))
                lens.append(check_int(ln, f"{what} run", 0, n))
            vals, lens = np.array(vals, dtype=np.int64), np.array(lens, dtype=np.int64)
        else:
            charge(16 * r, what)
            z, pos = decode_ints(buf, pos, r)
            vals = unzigzag(z)
            lens, pos = decode_ints(buf, pos, r)
            if r and (int(lens.min()) < 0 or int(lens.max()) >= n):
                raise TraceError(f"{what} has a run longer than its {n} values")
        if int(lens.sum()) + r != n:
            raise TraceError(f"{what} runs cover {int(lens.sum()) + r} values, not {n}")
        charge(8 * n, what)
        return np.repeat(vals, lens + 1), pos
    if m == C_PLAIN:
        charge(8 * n, what)
        z, pos = decode_ints(buf, pos, n)
        return unzigzag(z), pos
    if m == C_DELTA:
        v0, pos = get_zz(buf, pos)
        check_int(v0, what, -(1 << 63), (1 << 63) - 1)
        charge(16 * n, what)
        z, pos = decode_ints(buf, pos, max(n - 1, 0))
        if not n:
            raise TraceError(f"{what} is delta-coded but empty")
        out = np.empty(n, dtype=np.int64)
        out[0] = v0
        np.cumsum(unzigzag(z), out=out[1:])
        out[1:] += np.int64(v0)
        return out, pos
    raise TraceError(f"{what} has unknown column method {m}")


def _f16_bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype("<f2")).view("<u2").astype(np.uint64)


def _f32_bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype("<f4")).view("<u4").astype(np.uint64)


def encode_f16(x: np.ndarray, level: int = ZSTD_LEVEL) -> bytes:
    return encode_ints(_f16_bits(x), level)


def decode_f16(buf, pos: int, n: int) -> Tuple[np.ndarray, int]:
    u, pos = decode_ints(buf, pos, n)
    return u.astype("<u2").view("<f2").astype(np.float32), pos


def encode_f32(x: np.ndarray, level: int = ZSTD_LEVEL) -> bytes:
    return encode_ints(_f32_bits(x), level)


def decode_f32(buf, pos: int, n: int) -> Tuple[np.ndarray, int]:
    u, pos = decode_ints(buf, pos, n)
    return u.astype("<u4").view("<f4"), pos


# --------------------------------------------------------------------------------------------------
# error-bounded logit quantisation (capture=logits)
def quantize_logits(x: np.ndarray, bound: float) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """Uniform quantisation with step ``2 * bound``: ``|decoded - x| <= bound`` for every finite value.

    The bound is checked here with the decoder's own arithmetic; values that would break it (huge
    magnitudes) and every non-finite value (-inf, +inf, NaN, bit-exact) are stored verbatim as exceptions.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.ravel()
    step = 2.0 * float(bound)
    finite = np.isfinite(flat)
    q = np.zeros(flat.shape, dtype=np.int64)
    with np.errstate(invalid="ignore", over="ignore"):
        qf = np.rint(flat.astype(np.float64) / step)
    ok = finite & (np.abs(qf) < 2 ** 31)
    q[ok] = qf[ok].astype(np.int64)
    rec = dequant(q, step)
    err = np.abs(rec.astype(np.float64) - flat.astype(np.float64))
    ok &= err <= bound
    exc = np.flatnonzero(~ok)
    q[exc] = 0
    maxerr = float(err[ok].max()) if ok.any() else 0.0
    # zigzag of the quantised values; their spread is what zstd sees
    z = zigzag(q)
    nb = nbytes_for(int(z.max()) if z.size else 0)
    meta = {"shape": list(x.shape), "bound": float(bound), "qstep": step, "max_error": maxerr, "nb": nb}
    arrays = {"q": np.frombuffer(planes(z, nb), dtype=np.uint8), "exc_index": exc.astype(np.int64),
              "exc_value": flat[exc].view(np.uint32).copy()}
    return meta, arrays


def dequant(q: np.ndarray, step: float) -> np.ndarray:
    return (q.astype(np.float64) * step).astype(np.float32)


def dequantize_logits(meta: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> np.ndarray:
    shape = [check_int(d, "logits shape", 0, 1 << 40) for d in check_type(meta.get("shape"), list, "logits shape")]
    n = math.prod(shape)
    nb = check_int(meta.get("nb"), "logits byte width", 1, 8)
    bound = check_float(meta.get("bound"), "logits error bound", 0.0)
    qstep = check_float(meta.get("qstep"), "logits quantisation step", 0.0)
    max_error = check_float(meta.get("max_error"), "logits error", 0.0)
    q, ei, ev = arrays.get("q"), arrays.get("exc_index"), arrays.get("exc_value")
    if q is None or ei is None or ev is None or q.size != n * nb or ei.shape != ev.shape or ei.ndim != 1:
        raise TraceError("logits record has the wrong size")
    if not max_error <= bound:
        raise TraceError(f"logits record claims error {max_error} above its bound {bound}")
    q = unzigzag(unplanes(q.tobytes(), n, nb))
    out = dequant(q, qstep)
    idx = ei.astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise TraceError("logits exception index out of range")
    out[idx] = ev.astype("<u4").view("<f4")
    return out.reshape(shape)
