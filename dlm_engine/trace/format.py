"""Byte layout of a trace file (see ``docs/trace_format.md``).

A file is ``PREAMBLE`` (magic + version) followed by framed records::

    record := kind:u8  length:u32le  crc:u32le  payload[length]

``crc`` is CRC-32 over ``kind``, ``length`` and the payload, so any single damaged byte (payload,
length or kind) is detected; a record whose length runs past the end of the file is a truncation.
Payloads are either zstd frames (content size + content checksum, decompressed with a size bound)
or the compact per-sequence encoding of :func:`encode_seq`. No pickle anywhere.

Decoding is bounded: a frame's declared size is compared with what the record may legitimately hold
*before* anything is decompressed (the reader derives those limits from the header's shape facts, see
``reader.Limits``); JSON is size- and depth-limited; every integer that sizes an allocation is range-checked
with Python integers (no overflow). Anything malformed raises :class:`TraceError`.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import zstandard as zstd

from ..errors import UserError

MAGIC = b"\x89DLMT\r\n\x1a"          # PNG-style: catches text-mode transfers and truncated starts
VERSION = (2, 1)                    # major, minor of what this version writes
READ_MAJORS = (2,)                  # majors this version reads (any minor of each)
PREAMBLE = MAGIC + struct.pack("<HH", *VERSION)
REC_HEAD = struct.Struct("<BII")    # kind, length, crc32
MAX_PAYLOAD = 1 << 31               # bound on one record's payload (compressed or not)
MAX_RAW = 1 << 26                   # default bound on one frame's decompressed size (64 MiB); readers pass tighter ones
MAX_JSON = 1 << 20                  # a JSON document (header, bundle index): at most 1 MiB ...
MAX_JSON_DEPTH = 32                 # ... and nested at most this deep
MAX_DIMS = 4                        # dimensions of a bundle array
SMALL_FRAME = 1 << 16               # bundles up to this size are decompressed whole when their index is read

# record kinds
HEADER, BATCH, STEPS, SEQ, BATCH_END, LOGITS, END = 1, 2, 3, 4, 5, 6, 7
KIND_NAMES = {HEADER: "header", BATCH: "batch", STEPS: "steps", SEQ: "sequence", BATCH_END: "batch-end",
              LOGITS: "logits", END: "end"}

CAPTURE_LEVELS = ("tokens", "confidence", "topk", "logits")
ZSTD_LEVEL = 9
HEADER_ZSTD_LEVEL = 3      # the provenance header: once a run, on the caller's thread, outside the size targets


class TraceError(UserError):
    """A trace file is unreadable (or cannot be written): the message names the problem in one line."""


# --------------------------------------------------------------------------------------------------
# framing
def record_crc(kind: int, head: bytes, payload, preamble: bytes = PREAMBLE) -> int:
    """CRC-32 of a record; the header record's CRC also covers the preamble (magic + version). A reader passes
    the file's own preamble, so a file of another minor version checks out against its own bytes."""
    seed = zlib.crc32(preamble) if kind == HEADER else 0
    return zlib.crc32(payload, zlib.crc32(head, seed))


def frame_record(kind: int, payload: bytes, preamble: bytes = PREAMBLE) -> bytes:
    if len(payload) >= MAX_PAYLOAD:
        raise TraceError(f"record of {len(payload)} bytes exceeds the format limit")
    head = struct.pack("<BI", kind, len(payload))
    crc = record_crc(kind, head, payload, preamble)
    return head + struct.pack("<I", crc) + payload


def check_preamble(data: bytes, name: str = "trace") -> int:
    """Check the magic number and version; returns the file's major version."""
    if len(data) < len(PREAMBLE):
        if MAGIC.startswith(bytes(data[:len(MAGIC)])):
            raise TraceError(f"{name}: truncated before the end of the file preamble ({len(data)} bytes)")
        raise TraceError(f"{name}: not a dlm_engine trace (bad magic)")
    if bytes(data[:len(MAGIC)]) != MAGIC:
        raise TraceError(f"{name}: not a dlm_engine trace (bad magic)")
    major, minor = struct.unpack_from("<HH", data, len(MAGIC))
    if major not in READ_MAJORS:
        raise TraceError(f"{name}: unsupported trace format version {major}.{minor} "
                         f"(this dlm_engine reads {' and '.join(f'{m}.x' for m in READ_MAJORS)})")
    return major


# --------------------------------------------------------------------------------------------------
# zstd with checksums and bounded decompression
# A zstd context serves one operation at a time (python-zstandard's instances are not thread safe, and it releases
# the GIL while it works): two threads compressing with one context -- two recorders' writer threads, or a writer
# thread and a recorder opening its header -- wrote corrupt frames. Contexts are therefore taken from a pool for
# each call and put back after it (``list.pop`` and ``append`` are atomic under the GIL): reused, never shared.
_CCTX: Dict[int, List[zstd.ZstdCompressor]] = {}
_DCTX: List[zstd.ZstdDecompressor] = []


def zc(data: bytes, level: int = ZSTD_LEVEL) -> bytes:
    pool = _CCTX.get(level)
    if pool is None:
        pool = _CCTX.setdefault(level, [])
    try:
        c = pool.pop()
    except IndexError:
        c = zstd.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    try:
        return c.compress(data)
    finally:
        pool.append(c)


def _take_dctx() -> zstd.ZstdDecompressor:
    """A decompression context for this caller alone (give it back with ``_DCTX.append``)."""
    try:
        return _DCTX.pop()
    except IndexError:
        return zstd.ZstdDecompressor()


def frame_size(data) -> int:
    """The content size a zstd frame declares (it must declare one)."""
    try:
        size = zstd.frame_content_size(bytes(data[:18]))
    except zstd.ZstdError as exc:
        raise TraceError(f"bad zstd frame ({exc})") from None
    if size < 0:
        raise TraceError("zstd frame without content size")
    return size


def zd(data: bytes, limit: int = MAX_RAW, expect: Optional[int] = None) -> bytes:
    """Decompress one zstd frame; the declared content size must exist and stay within ``limit``
    (checked before anything is allocated)."""
    size = frame_size(data)
    if size > limit or (expect is not None and size != expect):
        raise TraceError(f"zstd frame declares {size} bytes (expected {expect if expect is not None else f'<= {limit}'})")
    d = _take_dctx()
    try:
        out = d.decompress(data, max_output_size=max(size, 1), allow_extra_data=False)
    except (zstd.ZstdError, MemoryError) as exc:
        raise TraceError(f"bad zstd frame ({exc})") from None
    finally:
        _DCTX.append(d)
    if len(out) != size:
        raise TraceError("zstd frame decompressed to the wrong size")
    return out


# --------------------------------------------------------------------------------------------------
# varints
def put_varint(out: bytearray, v: int) -> None:
    v = int(v)
    if v < 0:
        raise ValueError("varint must be >= 0")
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def get_varint(buf, pos: int) -> Tuple[int, int]:
    v, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise TraceError("record ends inside a varint")
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7
        if shift > 63:
            raise TraceError("varint too long")


# --------------------------------------------------------------------------------------------------
# bundles: a JSON index + raw little-endian arrays, zstd-compressed (batch/steps/end/logits records)
_DTYPES = {"u1": np.uint8, "i1": np.int8, "u2": np.uint16, "i2": np.int16, "u4": np.uint32, "i4": np.int32,
           "i8": np.int64, "u8": np.uint64, "f2": np.float16, "f4": np.float32, "f8": np.float64, "b1": np.bool_}


def _dtype_code(a: np.ndarray) -> str:
    for k, v in _DTYPES.items():
        if a.dtype == v:
            return k
    raise TypeError(f"unsupported array dtype {a.dtype}")


def encode_bundle(meta: Dict[str, Any], arrays: Optional[Dict[str, np.ndarray]] = None,
                  level: int = ZSTD_LEVEL) -> bytes:
    arrays = arrays or {}
    index, blobs = [], []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        code = _dtype_code(a)
        index.append([name, code, list(a.shape)])
        blobs.append(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    js = json.dumps({"m": meta, "a": index}, separators=(",", ":"), allow_nan=True).encode()
    head = bytearray()
    put_varint(head, len(js))
    return zc(bytes(head) + js + b"".join(blobs), level)


# --------------------------------------------------------------------------------------------------
# JSON documents: size- and depth-limited, integers range-checked by the caller (see ``check_int``)
def load_json(raw, what: str, max_bytes: int = MAX_JSON, max_depth: int = MAX_JSON_DEPTH) -> Any:
    if len(raw) > max_bytes:
        raise TraceError(f"{what} is {len(raw)} bytes of JSON (at most {max_bytes})")
    try:
        obj = json.loads(bytes(raw))
    except RecursionError:
        raise TraceError(f"{what} is JSON nested more than {max_depth} deep") from None
    except (ValueError, UnicodeDecodeError) as exc:   # JSONDecodeError, over-long integer literals
        raise TraceError(f"{what} is not valid JSON ({exc})") from None
    depth, todo = 0, [(obj, 1)]
    while todo:                                        # iterative: no recursion on hostile nesting
        o, d = todo.pop()
        if isinstance(o, (dict, list)):
            if d > max_depth:
                raise TraceError(f"{what} is JSON nested more than {max_depth} deep")
            depth = max(depth, d)
            todo.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o) if isinstance(v, (dict, list)))
    return obj


def check_int(v: Any, what: str, lo: int = 0, hi: int = (1 << 62)) -> int:
    """``v`` as an int in ``[lo, hi]``; bools, floats (1e400, NaN), strings and out-of-range values raise."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{what} is {_show(v)}, not an integer")
    if not lo <= v <= hi:
        raise TraceError(f"{what} = {_show(v)} is outside {lo}..{hi}")
    return v


def check_float(v: Any, what: str, lo: float = -math.inf, hi: float = math.inf, finite: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceError(f"{what} is {_show(v)}, not a number")
    v = float(v)
    if (finite and not math.isfinite(v)) or not (lo <= v <= hi):
        raise TraceError(f"{what} = {_show(v)} is outside {lo}..{hi}")
    return v


def check_type(v: Any, typ, what: str, optional: bool = False):
    if v is None and optional:
        return v
    if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
        name = {dict: "an object", list: "a list", str: "a string"}.get(typ, getattr(typ, "__name__", str(typ)))
        raise TraceError(f"{what} is {_show(v)}, not {name}")
    return v


def _show(v: Any) -> str:
    r = repr(v) if not isinstance(v, (dict, list)) else f"a JSON {'object' if isinstance(v, dict) else 'list'}"
    return r if len(r) <= 40 else r[:37] + "..."


# --------------------------------------------------------------------------------------------------
# bundle decoding: the JSON index is read first (a bounded prefix of the frame), the arrays it declares are
# sized with Python integers and compared with the frame's declared size and the caller's limit; only then
# is the frame decompressed.
@dataclass
class BundleHead:
    meta: Dict[str, Any]
    arrays: List[Tuple[str, str, Tuple[int, ...]]]     # name, dtype code, shape
    offset: int                                        # where the arrays start in the decompressed bytes
    size: int                                          # the frame's declared content size
    raw: Optional[bytes] = None                        # the decompressed frame, when it was small enough to read whole

    def shape(self, name: str) -> Optional[Tuple[int, ...]]:
        for n, _, sh in self.arrays:
            if n == name:
                return sh
        return None

    @property
    def array_bytes(self) -> int:
        return self.size - self.offset


def _read_exact(reader, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = reader.read(n - len(out))
        if not chunk:
            raise TraceError("bundle index runs past the record")
        out += chunk
    return bytes(out)


def read_bundle_head(payload, max_index: int = MAX_JSON, max_size: Optional[int] = None) -> BundleHead:
    """The metadata and array index of a bundle, decompressing only the index's bytes. ``max_size`` bounds
    the frame's declared size (checked first, from the frame header alone)."""
    size = frame_size(payload)
    if max_size is not None and size > max_size:
        raise TraceError(f"bundle frame declares {size} bytes, this record may hold at most {max_size}")
    raw = None
    if size <= SMALL_FRAME:            # small: decompress it whole, once (a bounded, tiny allocation)
        raw = zd(payload, limit=size)
        n, pos = get_varint(raw, 0)
        if n > max_index:
            raise TraceError(f"bundle index of {n} bytes (at most {max_index})")
        if pos + n > size:
            raise TraceError("bundle index runs past the record")
        rest = raw[pos:pos + n]
    else:                              # large: decompress only the index's bytes
        d = _take_dctx()
        try:
            reader = d.stream_reader(bytes(payload) if not isinstance(payload, bytes) else payload)
            first = reader.read(min(size, 10))
            n, pos = get_varint(first, 0)
            if n > max_index:
                raise TraceError(f"bundle index of {n} bytes (at most {max_index})")
            if pos + n > size:
                raise TraceError("bundle index runs past the record")
            rest = first[pos:] + _read_exact(reader, max(0, pos + n - len(first)))
        except zstd.ZstdError as exc:
            raise TraceError(f"bad zstd frame ({exc})") from None
        finally:
            _DCTX.append(d)
    idx = load_json(rest[:n], "bundle index", max_bytes=max_index)
    if not isinstance(idx, dict) or not isinstance(idx.get("m"), dict) or not isinstance(idx.get("a"), list):
        raise TraceError("bundle index is not {\"m\": {...}, \"a\": [...]}")
    arrays, seen, total = [], set(), 0
    for ent in idx["a"]:
        if not (isinstance(ent, list) and len(ent) == 3 and isinstance(ent[0], str) and isinstance(ent[1], str)
                and isinstance(ent[2], list)):
            raise TraceError("bundle array entry is not [name, dtype, shape]")
        name, code, shape = ent
        if code not in _DTYPES:
            raise TraceError(f"bundle array '{name[:40]}' has unknown dtype '{code[:8]}'")
        if name in seen or len(name) > 128:
            raise TraceError(f"bundle array name '{name[:40]}' is repeated or too long")
        seen.add(name)
        if len(shape) > MAX_DIMS:
            raise TraceError(f"bundle array '{name}' has {len(shape)} dimensions")
        dims = tuple(check_int(d, f"bundle array '{name}' dimension", 0, 1 << 40) for d in shape)
        total += math.prod(dims) * np.dtype(_DTYPES[code]).itemsize
        arrays.append((name, code, dims))
    if pos + n + total != size:
        raise TraceError(f"bundle arrays need {total} bytes, the frame holds {size - pos - n}")
    return BundleHead(idx["m"], arrays, pos + n, size, raw)


def decode_bundle(payload, limit: int = MAX_RAW, head: Optional[BundleHead] = None
                  ) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """Metadata and arrays of a bundle; its arrays may use at most ``limit`` bytes."""
    head = head or read_bundle_head(payload)
    if head.array_bytes > limit:
        raise TraceError(f"bundle arrays of {head.array_bytes} bytes exceed the {limit} this record may hold")
    raw = head.raw if head.raw is not None else zd(payload, limit=head.size, expect=head.size)
    arrays, pos = {}, head.offset
    for name, code, shape in head.arrays:
        dt = np.dtype(_DTYPES[code]).newbyteorder("<")
        count = math.prod(shape)
        arrays[name] = np.frombuffer(raw, dtype=dt, count=count, offset=pos).reshape(shape)
        pos += count * dt.itemsize
    return head.meta, arrays


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
# the per-sequence record
F_CONF, F_EDITS, F_TOPK = 1, 2, 4


@dataclass
class SeqData:
    """One row's final state; ``tokens``/``step_of`` cover the generation region only."""

    row: int
    tokens: np.ndarray                      # [L] int64
    step_of: np.ndarray                     # [L] int64: -1 masked, 0 given, t >= 1 committed at step t
    nfe: int = 0
    finish_step: int = -1                   # step after which the row was finished (-1: never marked)
    confidence: Optional[np.ndarray] = None  # [L] float32 (float16 precision); NaN where never committed
    # earlier holdings of positions that were later remasked or overwritten: column (absolute canvas
    # column), token, first step held, first step no longer held, confidence
    edits: Optional[Dict[str, np.ndarray]] = None
    topk_ids: Optional[np.ndarray] = None     # [n_committed, k] int64 (committed positions, in column order)
    topk_logits: Optional[np.ndarray] = None  # [n_committed, k] float32


def encode_seq(s: SeqData, level: int = ZSTD_LEVEL) -> bytes:
    return encode_seqs([s], level)[0]


def encode_seqs(seqs: Sequence[SeqData], level: int = ZSTD_LEVEL) -> List[bytes]:
    """The sequence record of each of ``seqs`` (what :func:`encode_seq` gives for each), with every candidate
    coding of all of them sized in one :class:`_Sizer` pass: a batch's records take about the numpy calls of
    one (the writer encodes a batch's records together at its end)."""
    sizer = _Sizer()
    preps = [_seq_prep(s, sizer) for s in seqs]
    sizer.run()
    return [_seq_build(p, sizer, level) for p in preps]


def _f16_bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype("<f2")).view("<u2").astype(np.uint64)


def _f32_bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype("<f4")).view("<u4").astype(np.uint64)


def _seq_prep(s: SeqData, sizer: "_Sizer") -> Dict[str, Any]:
    """What a sequence record's encoding needs, its candidate streams registered with ``sizer``."""
    L = int(s.tokens.shape[0])
    flags = (F_CONF if s.confidence is not None else 0) | (F_EDITS if s.edits is not None and len(s.edits["col"]) else 0) \
        | (F_TOPK if s.topk_ids is not None else 0)
    tok = s.tokens.astype(np.int64)
    if L and int(tok.min()) < 0:
        raise ValueError("negative token id")
    zs = zigzag(delta0(s.step_of))
    p = {"s": s, "L": L, "flags": flags, "tok": tok, "zs": zs, "tokens": _tokens_prep(tok, sizer),
         "steps": _steps_prep(s.step_of, zs, sizer)}
    if flags & F_CONF:
        p["conf"] = sizer.ints(_f16_bits(np.asarray(s.confidence)[s.step_of >= 1]))
    if flags & F_EDITS:
        e = s.edits
        p["edits"] = [sizer.ints(np.asarray(e[k], dtype=np.int64)) for k in ("col", "token", "start", "end")]
        if flags & F_CONF:
            p["edits"].append(sizer.ints(_f16_bits(np.asarray(e["confidence"], dtype=np.float32))))
    if flags & F_TOPK:
        ids = np.asarray(s.topk_ids, dtype=np.int64)
        p["topk"] = (ids.shape, sizer.ints(ids.ravel()),
                     sizer.ints(_f32_bits(np.asarray(s.topk_logits, dtype=np.float32).ravel())))
    return p


def _seq_build(p: Dict[str, Any], sizer: "_Sizer", level: int) -> bytes:
    s, L, tok, zs = p["s"], p["L"], p["tok"], p["zs"]
    out = bytearray()
    for v in (s.row, L, s.nfe, s.finish_step + 1, p["flags"]):
        put_varint(out, v)
    # layout 4: the smallest token coding and the smallest step coding, chosen independently
    cands = [b"\x04" + _tokens_build(p["tokens"], sizer, level) + _steps_build(p["steps"], sizer, level)]
    if L:   # layout 1: one zstd frame of token + step byte planes
        tb, sb = sizer.plan(p["tokens"]["plain"])[4], sizer.plan(p["steps"]["deltas"])[4]   # (bytes of their maxima)
        joint = zc(planes(tok, tb) + planes(zs, sb), level)
        head = bytearray((1, tb, sb))
        put_varint(head, len(joint))
        cands.append(bytes(head) + joint)
    out += min(cands, key=len)
    if "conf" in p:
        out += encode_ints(None, level, sizer.plan(p["conf"]))
    if "edits" in p:
        put_varint(out, len(s.edits["col"]))
        for h in p["edits"]:
            out += encode_ints(None, level, sizer.plan(h))
    if "topk" in p:
        (n, k), ids, logits = p["topk"]
        put_varint(out, n)
        put_varint(out, k)
        out += encode_ints(None, level, sizer.plan(ids)) + encode_ints(None, level, sizer.plan(logits))
    return bytes(out)


def _tokens_prep(tok: np.ndarray, sizer: "_Sizer") -> Dict[str, Any]:
    """Token codings (``method:u8`` then): 0 ints(ids); 1 / 2 a sorted dictionary of the distinct ids
    (``varint U``, ints of its gaps) and each position's index into it as ints (1) or as a column (2: runs, e.g.
    an EOS tail). All are sized; :func:`_tokens_build` builds the smallest."""
    if not tok.size:
        return {"plain": sizer.ints(tok)}
    uniq, idx = np.unique(tok, return_inverse=True)
    idx = idx.ravel()
    return {"plain": sizer.ints(tok), "n_uniq": len(uniq), "gaps": sizer.ints(delta0(uniq)),
            "ints_idx": sizer.ints(idx), "col_idx": sizer.col(idx)}


def _tokens_build(t: Dict[str, Any], sizer: "_Sizer", level: int) -> bytes:
    plain = sizer.plan(t["plain"])
    if "gaps" not in t:
        return b"\x00" + encode_ints(None, level, plain)
    gaps, ints_idx, col_idx = sizer.plan(t["gaps"]), sizer.plan(t["ints_idx"]), sizer.col_plan(t["col_idx"])
    head = _plan_size(gaps) + 3
    m = min((_plan_size(plain), 0), (head + _plan_size(ints_idx), 1), (head + col_idx[0], 2))[1]
    if m == 0:
        return b"\x00" + encode_ints(None, level, plain)
    out = bytearray((m,))
    put_varint(out, t["n_uniq"])
    out += encode_ints(None, level, gaps)
    return bytes(out) + (encode_ints(None, level, ints_idx) if m == 1 else encode_col(None, level, col_idx))


def _decode_tokens(buf, pos: int, L: int) -> Tuple[np.ndarray, int]:
    if pos >= len(buf):
        raise TraceError("sequence record is cut short")
    m = buf[pos]
    pos += 1
    if m == 0:
        return decode_ints(buf, pos, L)
    if m not in (1, 2):
        raise TraceError(f"sequence record has unknown token coding {m}")
    return _decode_dict(buf, pos, L, as_col=m == 2)


def _decode_dict(buf, pos: int, L: int, as_col: bool) -> Tuple[np.ndarray, int]:
    """Token ids as a sorted dictionary (``varint U``, ints of its gaps) and an index per position."""
    nu, pos = get_varint(buf, pos)
    if nu > L or (L and nu == 0):
        raise TraceError("sequence record has a bad dictionary size")
    gaps, pos = decode_ints(buf, pos, nu)
    idx, pos = decode_col(buf, pos, L, "token index") if as_col else decode_ints(buf, pos, L)
    if L and not 0 <= int(idx.min()) <= int(idx.max()) < nu:
        raise TraceError("sequence record has a dictionary index out of range")
    if nu and int(gaps.min()) < 0:
        raise TraceError("sequence record has a bad token dictionary")
    return np.cumsum(gaps)[idx], pos


ORDER_CHUNK = 64          # values per mixed-radix integer


class _Remaining:
    """The positions still to commit, as a Fenwick tree over their indices: rank and select in O(log m)."""

    def __init__(self, m: int):
        self.m = m
        self.tree = [0] + [i & -i for i in range(1, m + 1)]      # every index present
        self.top = 1 << max(m.bit_length() - 1, 0)

    def rank(self, i: int) -> int:
        """How many remaining indices are below ``i``."""
        t, r = self.tree, 0
        while i > 0:
            r += t[i]
            i -= i & -i
        return r

    def select(self, r: int) -> int:
        """The remaining index of rank ``r`` (0-based)."""
        t, pos, step = self.tree, 0, self.top
        while step:
            if pos + step <= self.m and t[pos + step] <= r:
                pos += step
                r -= t[pos]
            step >>= 1
        return pos

    def remove(self, i: int) -> None:
        t, i = self.tree, i + 1
        while i <= self.m:
            t[i] -= 1
            i += i & -i


def _steps_prep(step_of: np.ndarray, zs: np.ndarray, sizer: "_Sizer") -> Dict[str, Any]:
    """Step codings (``method:u8`` then): 0 ints(zigzag deltas); 1 a column; 2 / 3 the commit order
    (:func:`_order_prep`). All are sized; :func:`_steps_build` builds the smallest."""
    return {"deltas": sizer.ints(zs), "col": sizer.col(step_of), "order": _order_prep(step_of, sizer)}


def _steps_build(t: Dict[str, Any], sizer: "_Sizer", level: int) -> bytes:
    deltas, col, order = sizer.plan(t["deltas"]), sizer.col_plan(t["col"]), t["order"]
    cands = [(_plan_size(deltas), 0), (col[0], 1)]
    if order is not None:
        head, vals, radix = _order_head(order, sizer, level), order["vals"], order["radix"]
        bits = float(np.log2(np.asarray(radix, dtype=np.float64)).sum()) if radix else 0.0
        ranks = sizer.plan(order["ranks"])
        cands += [(len(head) + int(bits / 8) + 2 * (len(vals) // ORDER_CHUNK + 1), 2),
                  (len(head) + _plan_size(ranks), 3)]
    m = min(cands)[1]
    if m == 0:
        return b"\x00" + encode_ints(None, level, deltas)
    if m == 1:
        return b"\x01" + encode_col(None, level, col)
    if m == 2:
        return b"\x02" + head + _pack_radix(vals, radix)
    return b"\x03" + head + encode_ints(None, level, ranks)


def _pack_radix(vals: List[int], radix: List[int]) -> bytes:
    out = bytearray()
    for c in range(0, len(vals), ORDER_CHUNK):
        acc, mult = 0, 1
        for v, b in zip(vals[c:c + ORDER_CHUNK], radix[c:c + ORDER_CHUNK]):
            acc += v * mult
            mult *= b
        put_varint(out, (acc.bit_length() + 7) // 8)
        out += acc.to_bytes((acc.bit_length() + 7) // 8, "little")
    return bytes(out)


def _commit_order(so: np.ndarray, level: int) -> Optional[Tuple[bytes, List[int], List[int]]]:
    """The commit order of :func:`_order_prep` on its own: its header, the rank gaps and their radixes."""
    sizer = _Sizer()
    order = _order_prep(so, sizer)
    if order is None:
        return None
    sizer.run()
    return _order_head(order, sizer, level), order["vals"], order["radix"]


def _order_prep(so: np.ndarray, sizer: "_Sizer") -> Optional[Dict[str, Any]]:
    """The commit steps as the order positions were committed in: a class per position (0 committed at a
    step, 1 given, 2 still masked); the steps that commit anything (``varint S``, a column of their gaps
    ``s[i] - s[i-1] - 1`` from ``s[-1] = 0``, a column of their commit counts - 1); and for each such step
    the rank of each position it commits among the positions still to commit (ascending within the step, so
    each rank is coded as the gap to the previous one, with the radix that leaves room for the rest). Method 2
    packs these gaps as mixed-radix integers of ``ORDER_CHUNK`` values, each ``varint nbytes`` + its
    little-endian bytes: close to log2 of the number of possible orders (a permutation of 128 positions takes
    ~90 bytes, zigzag deltas ~130). Method 3 writes them as ints: smaller when the ranks are small (a block
    at a time, left to right). None where a step below -1 leaves it undefined."""
    if so.size and int(so.min()) < -1:
        return None
    committed = np.flatnonzero(so >= 1)
    cs = so[committed]
    busy, cnt = np.unique(cs, return_counts=True)      # (cnt: int64 counts of the busy steps)
    out = {"cls": sizer.col(np.where(so >= 1, 0, np.where(so == 0, 1, 2))), "S": busy.size,
           "gaps": sizer.col(np.diff(busy, prepend=0) - 1), "cnt": sizer.col(cnt - 1), "vals": [], "radix": []}
    m = committed.size
    if m:
        left = m - np.concatenate(([0], np.cumsum(cnt)[:-1]))          # positions still to commit at each step
        if m <= 1024:   # rank among those still to commit = earlier positions committed at the same step or later
            later = np.tril(cs[None, :] >= cs[:, None], -1)
            order = np.lexsort((np.arange(m), cs))                    # by step, then by position
            r = later.sum(1)[order]
        else:
            order = np.lexsort((np.arange(m), cs))
            rem, r = _Remaining(m), np.empty(m, dtype=np.int64)
            at = 0
            for k in cnt.tolist():
                idx = order[at:at + k].tolist()
                r[at:at + k] = [rem.rank(i) for i in idx]
                for i in idx:
                    rem.remove(i)
                at += k
        first = np.repeat(np.concatenate(([0], np.cumsum(cnt)[:-1])), cnt)   # where each commit's step starts
        j = np.arange(m) - first
        prev = np.where(j == 0, -1, np.concatenate(([-1], r[:-1])))
        out["vals"] = (r - prev - 1).tolist()
        out["radix"] = (np.repeat(left - cnt, cnt) + j - prev).tolist()
    out["ranks"] = sizer.ints(np.asarray(out["vals"], dtype=np.int64))
    return out


def _order_head(order: Dict[str, Any], sizer: "_Sizer", level: int) -> bytes:
    out = bytearray(encode_col(None, level, sizer.col_plan(order["cls"])))
    put_varint(out, order["S"])
    return bytes(out) + encode_col(None, level, sizer.col_plan(order["gaps"])) \
        + encode_col(None, level, sizer.col_plan(order["cnt"]))


def _decode_steps(buf, pos: int, L: int, max_step: int) -> Tuple[np.ndarray, int]:
    if pos >= len(buf):
        raise TraceError("sequence record is cut short")
    m = buf[pos]
    pos += 1
    if m == 0:
        zs, pos = decode_ints(buf, pos, L)
        return np.cumsum(unzigzag(zs)), pos
    if m == 1:
        return decode_col(buf, pos, L, "commit steps")
    if m not in (2, 3):
        raise TraceError(f"sequence record has unknown step coding {m}")
    cls, pos = decode_col(buf, pos, L, "position classes")
    if L and not 0 <= int(cls.min()) <= int(cls.max()) <= 2:
        raise TraceError("sequence record has a bad position class")
    committed = np.flatnonzero(cls == 0)
    S, pos = get_varint(buf, pos)
    if S > committed.size or (committed.size and not S):
        raise TraceError(f"sequence record has {S} commit steps for {committed.size} commits")
    gaps, pos = decode_col(buf, pos, S, "commit steps")
    cnt, pos = decode_col(buf, pos, S, "commits per step")
    if S and (int(gaps.min()) < 0 or int(gaps.max()) > max_step or int(cnt.min()) < 0 or int(cnt.max()) >= L):
        raise TraceError("sequence record has a bad commit step or count")
    busy = np.cumsum(gaps + 1)
    cnt = cnt + 1
    if int(cnt.sum()) != committed.size:
        raise TraceError("sequence record commit counts do not match its positions")
    ranks = None
    if m == 3:
        ranks, pos = decode_ints(buf, pos, committed.size)
    m = committed.size
    if ranks is not None:          # method 3: every rank at once (the gaps add up within each step)
        v = ranks
        first = np.repeat(np.cumsum(cnt) - cnt, cnt)
        j = np.arange(m) - first
        c = np.cumsum(v + 1)
        r = c - np.where(first > 0, c[np.maximum(first - 1, 0)], 0) - 1
        prev = np.where(j == 0, -1, np.concatenate(([-1], r[:-1])))
        if m and (int(v.min()) < 0 or bool((v >= np.repeat(m - np.cumsum(cnt), cnt) + j - prev).any())):
            raise TraceError("sequence record has a bad commit order")
        rank = r.tolist()
    else:                          # method 2: mixed-radix digits, each radix known once the previous digit is
        rank, left, acc, nleft, i = [0] * m, m, 0, 0, 0
        for k in cnt.tolist():
            prev = -1
            for j in range(k):
                if not nleft:
                    if acc:
                        raise TraceError("sequence record has a bad commit order")
                    nb, pos = get_varint(buf, pos)
                    if nb > 8 * ORDER_CHUNK or pos + nb > len(buf):
                        raise TraceError("sequence record commit order runs past the record")
                    acc, pos, nleft = int.from_bytes(bytes(buf[pos:pos + nb]), "little"), pos + nb, ORDER_CHUNK
                acc, v = divmod(acc, left - k + j - prev)
                nleft -= 1
                prev += v + 1
                rank[i] = prev
                i += 1
            left -= k
        if acc:
            raise TraceError("sequence record has a bad commit order")
    step_of = np.where(cls == 1, 0, -1).astype(np.int64)
    step_of[committed[_order_positions(rank, cnt.tolist())]] = np.repeat(busy, cnt)
    return step_of, pos


def _order_positions(rank: List[int], cnt: List[int]) -> np.ndarray:
    """Which of the committed positions (by index, ascending) each commit took, from its rank among those still
    to commit when its step began. Built from the last step back: a step's commits join the positions of the
    later steps at their ranks (list inserts; a Fenwick tree's select above 8192 commits)."""
    m = len(rank)
    out = np.empty(m, dtype=np.int64)
    if m > 8192:
        rem, at = _Remaining(m), 0
        for k in cnt:
            picked = [rem.select(r) for r in rank[at:at + k]]
            out[at:at + k] = picked
            for x in picked:
                rem.remove(x)
            at += k
        return out
    order: List[int] = []                  # commit numbers in position order, for the steps seen so far
    end = m
    for k in reversed(cnt):
        for c in range(end - k, end):
            order.insert(rank[c], c)
        end -= k
    out[np.asarray(order, dtype=np.int64)] = np.arange(m)
    return out


@dataclass
class SeqLimits:
    """What a sequence record may hold, from the header and its batch record (see ``reader.Limits``)."""

    length: Optional[int] = None       # the exact number of positions (None: up to ``max_length``)
    max_length: int = 1 << 20
    vocab: int = 1 << 31               # token ids < vocab
    max_step: int = 1 << 30            # step_of, finish_step and edit steps <= max_step
    topk: Optional[int] = None         # the exact k of top-k tables (None: 1..1024)
    col_lo: int = 0                    # edit columns lie in [col_lo, col_hi) (the generation region)
    col_hi: int = 1 << 40


def decode_seq(buf: bytes, lim: Optional[SeqLimits] = None) -> SeqData:
    """Decode and range-check one sequence record; every size is checked against ``lim`` before use."""
    lim = lim or SeqLimits()
    row, pos = get_varint(buf, 0)
    L, pos = get_varint(buf, pos)
    nfe, pos = get_varint(buf, pos)
    fin, pos = get_varint(buf, pos)
    flags, pos = get_varint(buf, pos)
    if lim.length is not None and L != lim.length:
        raise TraceError(f"sequence record of row {row} has {L} positions, its batch has {lim.length}")
    if L > lim.max_length:
        raise TraceError(f"sequence record claims {L} positions")
    if flags & ~(F_CONF | F_EDITS | F_TOPK):
        raise TraceError(f"sequence record has unknown flags {flags}")
    check_int(nfe, "sequence NFE", 0, 1 << 40)
    if pos >= len(buf):
        raise TraceError("sequence record is cut short")
    layout = buf[pos]
    pos += 1
    if layout == 1:
        if pos + 2 > len(buf):
            raise TraceError("sequence record is cut short")
        tb, sb = buf[pos], buf[pos + 1]
        if not (1 <= tb <= 8 and 1 <= sb <= 8):
            raise TraceError("sequence record has a bad byte width")
        ln, pos = get_varint(buf, pos + 2)
        if pos + ln > len(buf):
            raise TraceError("sequence stream runs past the record")
        raw = zd(buf[pos:pos + ln], limit=L * (tb + sb), expect=L * (tb + sb))
        pos += ln
        tok = unplanes(raw, L, tb)
        zs = unplanes(raw, L, sb, offset=L * tb)
    elif layout == 4:
        tok, pos = _decode_tokens(buf, pos, L)
        step_of, pos = _decode_steps(buf, pos, L, lim.max_step)
        zs = None
    else:
        raise TraceError(f"unknown sequence layout {layout}")
    if zs is not None:
        step_of = np.cumsum(unzigzag(zs))
    _in_range(tok, 0, lim.vocab - 1, f"token id of row {row}")
    _in_range(step_of, -1, lim.max_step, f"commit step of row {row}")
    check_int(fin - 1, f"finish step of row {row}", -1, lim.max_step)
    s = SeqData(row=row, tokens=tok, step_of=step_of, nfe=nfe, finish_step=fin - 1)
    if flags & F_CONF:
        committed = step_of >= 1
        c, pos = decode_f16(buf, pos, int(committed.sum()))
        conf = np.full(L, np.nan, dtype=np.float32)
        conf[committed] = c
        s.confidence = conf
    if flags & F_EDITS:
        n, pos = get_varint(buf, pos)
        if n > max(L, 1) * (min(lim.max_step, 1 << 20) + 1):
            raise TraceError(f"sequence record of row {row} claims {n} edits")
        e = {}
        for key in ("col", "token", "start", "end"):
            e[key], pos = decode_ints(buf, pos, n)
        if flags & F_CONF:
            e["confidence"], pos = decode_f16(buf, pos, n)
        _in_range(e["col"], lim.col_lo, lim.col_hi - 1, f"edit column of row {row}")
        _in_range(e["token"], 0, lim.vocab - 1, f"edit token id of row {row}")
        _in_range(e["start"], 0, lim.max_step, f"edit step of row {row}")
        _in_range(e["end"], 0, lim.max_step, f"edit step of row {row}")
        if n and bool((e["end"] < e["start"]).any()):
            raise TraceError(f"sequence record of row {row} has an edit that ends before it starts")
        s.edits = e
    if flags & F_TOPK:
        n, pos = get_varint(buf, pos)
        k, pos = get_varint(buf, pos)
        if n != int((step_of >= 1).sum()):
            raise TraceError(f"sequence record of row {row} has {n} top-k rows for {int((step_of >= 1).sum())} commits")
        if (lim.topk is not None and k != lim.topk) or not 1 <= k <= 1024:
            raise TraceError(f"sequence record of row {row} has top-k tables of k={k}")
        ids, pos = decode_ints(buf, pos, n * k)
        lg, pos = decode_f32(buf, pos, n * k)
        _in_range(ids, 0, lim.vocab - 1, f"top-k token id of row {row}")
        s.topk_ids, s.topk_logits = ids.reshape(n, k), lg.reshape(n, k)
    if pos != len(buf):
        raise TraceError("sequence record has trailing bytes")
    return s


def _in_range(a: np.ndarray, lo: int, hi: int, what: str) -> None:
    if a.size and not (lo <= int(a.min()) and int(a.max()) <= hi):
        bad = a[(a < lo) | (a > hi)][0]
        raise TraceError(f"{what} = {int(bad)} is outside {lo}..{hi}")


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
