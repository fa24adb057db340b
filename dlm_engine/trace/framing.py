"""Framing of a trace file (``docs/trace_format.md``): the preamble, the record kinds, framed records with
their CRC-32, zstd frames with bounded decompression, varints, JSON documents and bundles (a JSON index and raw
arrays: the logits records).

A file is ``PREAMBLE`` (magic + version) followed by framed records::

    record := kind:u8  length:u32le  crc:u32le  payload[length]

``crc`` is CRC-32 over ``kind``, ``length`` and the payload, so any single damaged byte (payload,
length or kind) is detected; a record whose length runs past the end of the file is a truncation.
No pickle anywhere. Decoding is bounded: a frame's declared size is compared with what the record may
legitimately hold *before* anything is decompressed (the reader derives those limits from the header's shape
facts, see ``reader.Limits``); JSON is size- and depth-limited; every integer that sizes an allocation is
range-checked with Python integers (no overflow). Anything malformed raises :class:`TraceError`.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import zstandard as zstd

from ..errors import UserError

__all__ = [
    "MAGIC", "VERSION", "READ_MAJORS", "PREAMBLE", "REC_HEAD", "MAX_PAYLOAD", "MAX_RAW", "MAX_JSON",
    "MAX_JSON_DEPTH", "MAX_DIMS", "SMALL_FRAME", "HEADER", "BATCH", "STEPS", "SEQ", "BATCH_END", "LOGITS", "END",
    "KIND_NAMES", "CAPTURE_LEVELS", "ZSTD_LEVEL", "HEADER_ZSTD_LEVEL", "TraceError", "record_crc", "frame_record",
    "check_preamble", "zc", "frame_size", "zd", "put_varint", "get_varint", "encode_bundle", "load_json",
    "check_int", "check_float", "check_type", "in_range", "BundleHead", "read_bundle_head", "decode_bundle",
]

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


def in_range(a: np.ndarray, lo: int, hi: int, what: str) -> None:
    if a.size and not (lo <= int(a.min()) and int(a.max()) <= hi):
        bad = a[(a < lo) | (a > hi)][0]
        raise TraceError(f"{what} = {int(bad)} is outside {lo}..{hi}")


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
