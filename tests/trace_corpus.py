"""Hostile trace files: a generator of crafted files with valid checksums (and a recomputed end digest),
single-byte flips and truncations. Used by ``tests/test_trace_hostile.py`` and ``experiments/fuzz_trace.py``.

Every crafted file starts from a real trace (``base``) and changes what an attacker or a buggy writer could:
sizes declared by zstd frames (hand-made frames of RLE blocks: 128 KB that declare 4 GiB) and by varints
(runs, counts, dimensions), JSON shapes and nesting, integers out of range or of the wrong type, rows removed,
duplicated or reordered, counts that disagree. The record CRCs and the end record's digest are recomputed, so
only the reader's validation stands between these files and a wrong answer (or a traceback, or an exhausted
memory). ``crafted`` builds the set from a 2.x file (what the recorder writes; 2.x readers refuse 1.x files).
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Dict, List, Tuple

import numpy as np

from dlm_engine.trace import format as fmt
from dlm_engine.trace import framing, records, sequence
from dlm_engine.trace.reader import SLACK, check_header, scan_frames

Rec = Tuple[int, bytes]          # (kind, payload)
KINDS = {v: k for k, v in fmt.KIND_NAMES.items()}


# --------------------------------------------------------------------------------------------------
# taking a file apart and putting it back together with valid checksums and digest
def parse(data: bytes) -> List[Rec]:
    recs, damage = scan_frames(data)
    assert not damage, damage
    return [(r.kind, bytes(r.payload)) for r in recs]


def preamble(major: int) -> bytes:
    return fmt.MAGIC + struct.pack("<HH", major, 0)


def assemble(recs: List[Rec], fix_end: bool = True, major: int = fmt.VERSION[0]) -> bytes:
    """Frame ``recs`` (CRCs recomputed); the end record's digest, offset and counts describe what precedes it."""
    pre = preamble(major)
    out = bytearray(pre)
    counts: Dict[str, int] = {}
    for kind, payload in recs:
        if kind == fmt.END and fix_end and len(payload) < 4096:   # (a crafted end record itself stays as it is)
            named = {name: counts.get(name, 0) for name in fmt.KIND_NAMES.values()}
            try:
                meta = records.decode_end(payload)
            except fmt.TraceError:
                meta = None
            if meta is not None:
                meta.update(sha256_before_end=hashlib.sha256(out).hexdigest(), bytes_before_end=len(out),
                            records=named)
                payload = records.encode_end(meta, KINDS)
        out += fmt.frame_record(kind, payload, pre)
        counts[fmt.KIND_NAMES[kind]] = counts.get(fmt.KIND_NAMES[kind], 0) + 1
    return bytes(out)


def rle_frame(prefix: bytes, fill: int, size: int) -> bytes:
    """A zstd frame of ``prefix`` (a raw block) then ``size`` bytes of ``fill`` as RLE blocks (4 bytes per
    128 KiB): a few KB of file that declare (and would decompress to) gigabytes."""
    out = bytearray(struct.pack("<I", 0xFD2FB528))
    out.append(0xC0)                                    # 8-byte content size, a window descriptor, no checksum
    out.append(7 << 3)                                  # a 128 KiB window: decoders accept it, whatever the size
    out += struct.pack("<Q", len(prefix) + size)
    blocks = [(0, len(prefix), prefix)] if prefix else []
    left = size
    while left > 0:
        n = min(left, 1 << 17)
        blocks.append((1, n, bytes([fill])))
        left -= n
    for i, (typ, n, body) in enumerate(blocks):
        out += (int(i == len(blocks) - 1) | (typ << 1) | (n << 3)).to_bytes(3, "little") + body
    return bytes(out)


def raw_bundle(meta, index, array_bytes: int, fill: int = 0) -> bytes:
    """A bundle whose arrays are ``array_bytes`` of ``fill``, declared by the frame (crafted, not compressed)."""
    js = json.dumps({"m": meta, "a": index}, separators=(",", ":")).encode()
    head = bytearray()
    fmt.put_varint(head, len(js))
    return rle_frame(bytes(head) + js, fill, array_bytes)


def header_payload(h) -> bytes:
    return fmt.zc(json.dumps(h).encode() if not isinstance(h, bytes) else h)


def seq_payload(row: int, L: int, nfe: int, fin: int, flags: int, body: bytes) -> bytes:
    out = bytearray()
    for v in (row, L, nfe, fin + 1, flags):
        fmt.put_varint(out, v)
    return bytes(out) + body


def ints(v) -> bytes:
    return fmt.encode_ints(np.asarray(v, dtype=np.int64))


# --------------------------------------------------------------------------------------------------
PROMPTS = ["347+085=", "hi", "name a fruit:", "sum 9:", "x", "12-3=", "abc", "red?"]


def record_base(path, capture: str = "tokens", batch_size: int = 3, prompts=PROMPTS, gen_length: int = 16,
                step_chunk: int = 5) -> bytes:
    """A real trace: the seeded random tiny model, low_confidence, 3 batches; its header declares the shape.
    ``step_chunk``: steps per step table, so that a batch of 8 steps has a steps record and a batch-end table."""
    import torch

    from dlm_engine.app.api import load_model, run_prompts
    from dlm_engine.core.registry import STRATEGIES, cache_class, load_plugins
    from dlm_engine.trace import TraceRecorder

    load_plugins()
    from dlm_engine.app.config import model_preset

    lm = load_model(model_preset("tiny_random"), "cpu", "float32")
    ids = [lm.encode(p) for p in prompts]
    V = max(lm.config.get("vocab_size") or 0, lm.config.get("embedding_size") or 0)
    header = {"model": {"name": "tiny_random", "eos_id": lm.eos_id, "mask_id": lm.mask_id, "vocab_size": V},
              "tokenizer": {"kind": "char"}, "rows_expected": len(ids), "seed": 0, "package": {"version": "test"},
              "config": {"strategy": {"name": "low_confidence"}, "cache": {"name": "none"}, "gen_length": gen_length,
                         "batch_size": batch_size},
              "shape": {"vocab_size": V, "batch_size": batch_size, "gen_length": gen_length,
                        "prompt_length": max(len(i) for i in ids)}}
    cls = STRATEGIES["low_confidence"]
    conf = cls.Config(steps=gen_length // 2, block_length=8)
    torch.manual_seed(0)
    from dlm_engine.trace import recorder as R

    chunk, R.STEP_CHUNK = R.STEP_CHUNK, step_chunk
    try:
        with TraceRecorder(str(path), header, capture=capture) as rec:
            run_prompts(lm, ids, lambda: cls(conf, gen_length), lambda: cache_class("none")(cache_class("none").Config()),
                        gen_length, batch_size, sinks_for_batch=lambda b, rows: [rec.sink(b, rows)], warmup=False)
    finally:
        R.STEP_CHUNK = chunk
    with open(path, "rb") as f:
        return f.read()


# --------------------------------------------------------------------------------------------------
def _kinds(recs, kind) -> List[int]:
    return [i for i, (k, _) in enumerate(recs) if k == kind]


def _with(recs, i, payload) -> List[Rec]:
    out = list(recs)
    out[i] = (out[i][0], payload)
    return out


def _edit_header(recs, fn) -> List[Rec]:
    h = json.loads(fmt.zd(recs[0][1]))
    fn(h)
    return _with(recs, 0, header_payload(h))


def _edit_seq(recs, fn, which: int = 0) -> List[Rec]:
    i = _kinds(recs, fmt.SEQ)[which]
    s = fmt.decode_seq(recs[i][1])
    fn(s)
    return _with(recs, i, fmt.encode_seq(s))


def crafted(base: bytes) -> Dict[str, bytes]:
    """Every class of hostile file, by name; each has valid record checksums and a matching end digest."""
    return crafted_v2(base)


# --------------------------------------------------------------------------------------------------
# cases of the header and the sequence records
def _seq_bombs(recs) -> Dict[str, List[Rec]]:
    """Sequence records whose streams declare far more than the record may hold."""
    out: Dict[str, List[Rec]] = {}
    first_seq = fmt.decode_seq(recs[_kinds(recs, fmt.SEQ)[0]][1])
    L = int(first_seq.tokens.shape[0])
    frame = rle_frame(b"", 0, 1 << 30)
    var = bytearray()
    fmt.put_varint(var, len(frame))
    row0 = first_seq.row       # layout 1 (token + step byte planes in one frame), one byte each
    out["sequence stream declaring 1 GiB"] = _with(recs, _kinds(recs, fmt.SEQ)[0],
                                                   seq_payload(row0, L, 1, -1, 0, bytes([1, 1, 1]) + bytes(var) + frame))
    out["sequence claiming 2^26 positions"] = _with(recs, _kinds(recs, fmt.SEQ)[0],
                                                    seq_payload(row0, 1 << 26, 1, -1, 0, bytes([1, 1, 1]) + bytes(var) + frame))
    zint = bytes([fmt.M_ZPLANES, 8])
    fr = rle_frame(b"", 0, 1 << 30)
    ln = bytearray()
    fmt.put_varint(ln, len(fr))
    out["integer stream declaring 1 GiB"] = _with(recs, _kinds(recs, fmt.SEQ)[0],
                                                  seq_payload(row0, L, 1, -1, 0, bytes([0]) + zint + bytes(ln) + fr + ints([1] * L)))
    s0 = fmt.decode_seq(recs[_kinds(recs, fmt.SEQ)[0]][1])
    core = fmt.encode_seq(fmt.SeqData(row=s0.row, tokens=s0.tokens, step_of=s0.step_of, nfe=s0.nfe,
                                      finish_step=s0.finish_step))
    streams = core[len(seq_payload(s0.row, L, s0.nfe, s0.finish_step, 0, b"")):]
    huge = bytearray()
    fmt.put_varint(huge, 1 << 40)
    out["edit list of 2^40 entries"] = _with(recs, _kinds(recs, fmt.SEQ)[0], seq_payload(
        s0.row, L, s0.nfe, s0.finish_step, fmt.F_EDITS, streams + bytes(huge) + ints([0])))
    return out


def _header_cases(recs, header) -> Dict[str, List[Rec]]:
    """JSON nesting, size, wrong shapes and types in the header."""
    out: Dict[str, List[Rec]] = {}
    out["header JSON nested 100k deep"] = _with(recs, 0, header_payload(b"[" * 100000 + b"]" * 100000))
    out["header JSON nested 40 deep"] = _with(recs, 0, header_payload(json.dumps(
        dict(header, x=json.loads("[" * 40 + "]" * 40))).encode()))
    out["header is a JSON list"] = _with(recs, 0, header_payload(b"[1, 2, 3]"))
    out["header of 2 MiB"] = _with(recs, 0, header_payload(json.dumps(dict(header, pad="x" * (2 << 20))).encode()))
    out["header not JSON"] = _with(recs, 0, header_payload(b"{not json"))
    out["header integer of 5000 digits"] = _with(recs, 0, header_payload(
        json.dumps(header)[:-1].encode() + b', "big": ' + b"9" * 5000 + b"}"))
    for name, fn in {
        "model is a string": lambda h: h.update(model="llada"),
        "tokenizer is a list": lambda h: h.update(tokenizer=[1]),
        "config.strategy is a string": lambda h: h["config"].update(strategy="threshold"),
        "rows_expected NaN": lambda h: h.update(rows_expected=float("nan")),
        "rows_expected a string": lambda h: h.update(rows_expected="24"),
        "rows_expected 1e400": lambda h: h.update(rows_expected=float("inf")),
        "rows_expected negative": lambda h: h.update(rows_expected=-1),
        "eos_id NaN": lambda h: h["model"].update(eos_id=float("nan")),
        "eos_id a string": lambda h: h["model"].update(eos_id="2"),
        "mask_id outside the vocabulary": lambda h: h["model"].update(mask_id=10 ** 9),
        "vocab_size 0": lambda h: h["shape"].update(vocab_size=0),
        "vocab_size 2^40": lambda h: h["shape"].update(vocab_size=1 << 40),
        "batch_size 1e20": lambda h: h["shape"].update(batch_size=1e20),
        "gen_length a list": lambda h: h["shape"].update(gen_length=[16]),
        "capture level unknown": lambda h: h["capture"].update(level="everything"),
        "capture topk 1e9": lambda h: h["capture"].update(level="topk", topk=10 ** 9),
        "overrides hold a number": lambda h: h.update(overrides=[1]),
        "seed beyond 64 bits": lambda h: h.update(seed=1 << 70),
        "package.git is a string": lambda h: h["package"].update(git="abc"),
    }.items():
        out[f"header: {name}"] = _edit_header(recs, fn)
    return out


def _seq_cases(recs, header, gen_start: int) -> Dict[str, List[Rec]]:
    out: Dict[str, List[Rec]] = {}
    first_seq = fmt.decode_seq(recs[_kinds(recs, fmt.SEQ)[0]][1])
    row0, L = first_seq.row, int(first_seq.tokens.shape[0])
    # -- sequence records ---------------------------------------------------------------------------------------
    vocab = header["shape"]["vocab_size"]
    out["sequence: token id 1e9"] = _edit_seq(recs, lambda s: s.tokens.__setitem__(0, 10 ** 9))
    out["sequence: token id = vocabulary"] = _edit_seq(recs, lambda s: s.tokens.__setitem__(1, vocab))
    out["sequence: step_of 1e12"] = _edit_seq(recs, lambda s: s.step_of.__setitem__(0, 10 ** 12))
    out["sequence: step_of -5"] = _edit_seq(recs, lambda s: s.step_of.__setitem__(0, -5))
    out["sequence: committed after the last step"] = _edit_seq(recs, lambda s: s.step_of.__setitem__(0, int(s.step_of.max()) + 1))
    out["sequence: finish step 1e9"] = _edit_seq(recs, lambda s: setattr(s, "finish_step", 10 ** 9))
    out["sequence: wrong length"] = _edit_seq(recs, lambda s: [setattr(s, k, getattr(s, k)[:-1]) for k in (
        "tokens", "step_of", "confidence") if getattr(s, k) is not None])
    out["sequence: row outside every batch"] = _edit_seq(recs, lambda s: setattr(s, "row", 10 ** 6))
    out["sequence: edit column outside the region"] = _edit_seq(recs, lambda s: setattr(s, "edits", {
        "col": np.array([0]), "token": np.array([1]), "start": np.array([0]), "end": np.array([1]),
        "confidence": np.array([0.5])}))
    out["sequence: edit that ends before it starts"] = _edit_seq(recs, lambda s: setattr(s, "edits", {
        "col": np.array([gen_start]), "token": np.array([1]), "start": np.array([3]), "end": np.array([1]),
        "confidence": np.array([0.5])}))
    out["sequence: unknown flags"] = _with(recs, _kinds(recs, fmt.SEQ)[0], seq_payload(row0, L, 1, -1, 64, b""))
    out["sequence: NFE above its batch's model calls"] = _edit_seq(recs, lambda s: setattr(s, "nfe", 10 ** 6))
    out["sequence: top-k table the capture level has not"] = _edit_seq(recs, lambda s: (
        setattr(s, "topk_ids", np.zeros((int((s.step_of >= 1).sum()), 2), np.int64)),
        setattr(s, "topk_logits", np.zeros((int((s.step_of >= 1).sum()), 2), np.float32))))

    return out


# --------------------------------------------------------------------------------------------------
# 2.x records taken apart and put back (records.py), and written field by field for what the writer never writes
def _header(recs):
    return json.loads(fmt.zd(recs[0][1]))


def batch_v2(recs, i):
    h = _header(recs)
    return records.decode_batch(recs[i][1], check_header(h), records.batch_defaults(h), SLACK)


def batch_v2_payload(recs, meta, arrays) -> bytes:
    fp = bytes.fromhex(meta["rng_sha256"]) if meta.get("rng_sha256") else None
    return records.encode_batch(meta, arrays["prompt_tokens"], arrays["prompt_mask"], fp,
                                records.batch_defaults(_header(recs)))


def _rows_of_batch(recs, batch: int) -> List[int]:
    for i in _kinds(recs, fmt.BATCH):
        meta, _ = batch_v2(recs, i)
        if meta["batch"] == batch:
            return meta["rows"]
    raise KeyError(batch)


def table_v2(recs, i):
    """``(head, meta, arrays)`` of the step table of a steps or batch-end record; ``head`` holds its batch
    (and the batch-end's totals)."""
    kind, payload = recs[i]
    if kind == fmt.STEPS:
        c = records.Cursor(payload)
        head = {"batch": c.varint("batch")}
        rows = _rows_of_batch(recs, head["batch"])
    else:
        head, c, has = records.decode_batch_end_head(payload, check_header(_header(recs)), 1 << 30)
        assert has, "this batch-end record has no step table"
        rows = head["rows"]
    big = lambda n: 1 << 40  # noqa: E731
    meta, arrays = records.decode_table(c, len(rows), 1 << 20, 1 << 30, big, big)
    return head, meta, {k: np.array(v) for k, v in arrays.items()}


def table_v2_payload(kind: int, head, meta, arrays) -> bytes:
    a = dict(arrays)
    a["wall_us"] = np.cumsum(a.pop("wall_dus")) if "wall_us" not in a else a["wall_us"]
    if "step" not in a:
        a["step"] = np.arange(meta["step0"], meta["step0"] + meta["n"])
    table = records.encode_table(meta, a, meta.get("wall_base", 0))
    return steps_payload(head["batch"], table) if kind == fmt.STEPS else records.encode_batch_end(head, table)


def steps_payload(batch: int, table: bytes) -> bytes:
    out = bytearray()
    fmt.put_varint(out, batch)
    return bytes(out) + table


def raw_table(n: int, cols: Dict[str, bytes], first: int = 0, step0: int = 1, flags: int = records.T_CONSECUTIVE,
              mb: int = records.WALL_MANTISSA, tail: bytes = b"\x00\x00\x00") -> bytes:
    """A step table written field by field, nothing checked: ``cols`` replaces any of the columns ``codes``,
    ``nfe``, ``start``, ``width``, ``active``, ``finished`` (bytes); ``tail`` = scalars, events, JSON scalars."""
    out = bytearray()
    for v in (first, n):
        fmt.put_varint(out, v)
    out.append(flags)
    if flags & records.T_CONSECUTIVE:
        fmt.put_varint(out, step0)
    body = bytearray((mb, 0))
    default = {"codes": 20, "nfe": 1, "start": 0, "width": 1, "active": 1, "finished": 0}    # constant columns
    for k in ("codes", "nfe", "start", "width", "active", "finished"):
        body += cols[k] if k in cols else _col([default[k]])
    return bytes(out + body + tail)


def _edit_batch_v2(recs, fn, which: int = 0) -> List[Rec]:
    i = _kinds(recs, fmt.BATCH)[which]
    meta, arrays = batch_v2(recs, i)
    arrays = {k: np.array(v) for k, v in arrays.items()}
    fn(meta, arrays)
    return _with(recs, i, batch_v2_payload(recs, meta, arrays))


def _edit_table_v2(recs, kind, fn, which: int = 0) -> List[Rec]:
    i = [j for j in _kinds(recs, kind) if kind == fmt.STEPS or records.decode_batch_end_head(
        recs[j][1], check_header(_header(recs)), 1 << 30)[2]][which]
    head, meta, arrays = table_v2(recs, i)
    fn(head, meta, arrays)
    return _with(recs, i, table_v2_payload(kind, head, meta, arrays))


def _edit_end_v2(recs, fn) -> List[Rec]:
    i = _kinds(recs, fmt.END)[0]
    meta = records.decode_end(recs[i][1])
    fn(meta)
    return _with(recs, i, records.encode_end(meta, KINDS))


def _varint(v: int) -> bytes:
    out = bytearray()
    fmt.put_varint(out, v)
    return bytes(out)


def _col(v) -> bytes:
    return fmt.encode_col(np.asarray(v, dtype=np.int64))


def crafted_v2(base: bytes) -> Dict[str, bytes]:
    """The hostile set of a 2.x file (binary batch, steps, batch-end and end records)."""
    recs = parse(base)
    header = _header(recs)
    assert _kinds(recs, fmt.STEPS), "the base needs a steps record (record_base with a small step_chunk)"
    si = _kinds(recs, fmt.STEPS)[0]
    head, tmeta, tarr = table_v2(recs, si)
    batch_meta, batch_arrays = batch_v2(recs, _kinds(recs, fmt.BATCH)[0])
    B = len(batch_meta["rows"])
    b0 = head["batch"]
    n = tmeta["n"]
    out: Dict[str, List[Rec]] = {}

    def steps(table: bytes) -> List[Rec]:
        return _with(recs, si, steps_payload(b0, table))

    def scalar(name_code: int, typ: int, dims, values, presence: bytes = b"\x00") -> bytes:
        """A tail of one scalar (well-known name index + 1) and no events or JSON scalars."""
        body = bytearray(b"\x01")
        fmt.put_varint(body, name_code)
        body += bytes((typ, len(dims))) + b"".join(_varint(d) for d in dims) + presence + _col(values)
        return bytes(body) + b"\x00\x00"

    # -- bombs: sizes declared by frames, varints and dimensions far beyond what the record may hold ----------
    out["steps table: zstd body declaring 4 GiB"] = steps(
        _varint(0) + _varint(n) + bytes((records.T_CONSECUTIVE | records.T_ZSTD,)) + _varint(1)
        + rle_frame(b"", 0, 4 << 30))
    out["steps table: 2^40 steps"] = steps(raw_table(1 << 40, {}))
    out["steps table: a column of 2^40 runs"] = steps(raw_table(n, {"nfe": b"\x01" + _varint(1 << 40)}))
    out["steps table: a few runs of 2^40 values"] = steps(raw_table(n, {"nfe": b"\x04\x01\x02" + _varint(1 << 40)}))
    out["steps table: a scalar of 2^32 x 2^32 values per step"] = steps(raw_table(n, {}, tail=scalar(
        5, records.S_INT, [1 << 32, 1 << 32], [0])))
    out["steps table: a scalar of 4 dimensions"] = steps(raw_table(n, {}, tail=scalar(5, records.S_INT, [1] * 4, [0])))
    out["steps table: 2^40 block events"] = steps(raw_table(n, {}, tail=b"\x00" + _varint(1 << 40) + b"\x00"))
    out["steps table: JSON scalars nested 100k deep"] = steps(raw_table(n, {}, tail=b"\x00\x00\x01" + _varint(
        200000) + b"[" * 100000 + b"]" * 100000))
    out["steps table: JSON scalars nested 10k deep"] = steps(raw_table(n, {}, tail=b"\x00\x00\x01" + _varint(
        20000) + b"[" * 10000 + b"]" * 10000))
    out["steps table: JSON scalars of 2 MiB"] = steps(raw_table(n, {}, tail=b"\x00\x00\x01" + _varint(
        (2 << 20) + 10) + json.dumps({"x": "y" * (2 << 20)}).encode()))
    rice = bytes((fmt.M_RICE, 0)) + _varint(64) + bytes((0,)) + b"\xff" * 63
    out["steps table: a Rice stream of endless quotients"] = steps(raw_table(n, {"codes": b"\x02" + rice}))
    out["batch: 2^40 generated positions"] = _edit_batch_v2(recs, lambda m, a: m.update(length=m["gen_start"] + (1 << 40)))
    out["batch: 2^27 prompt positions"] = _edit_batch_v2(recs, lambda m, a: (
        m.update(gen_start=1 << 27, length=(1 << 27) + 16), a.update(prompt_tokens=np.zeros((B, 1), np.int64),
                                                                     prompt_mask=np.ones((B, 1), bool))))
    out["end: a status of 2^40 bytes"] = _with(recs, _kinds(recs, fmt.END)[0], b"\x02" + _varint(1 << 40))
    out.update(_seq_bombs(recs))
    out.update(_header_cases(recs, header))

    # -- step tables: values out of range, malformed fields ------------------------------------------------------
    out["steps table: unknown flags"] = steps(raw_table(n, {}, flags=0x81))
    out["steps table: wall time precision of 0 bits"] = steps(raw_table(n, {}, mb=0))
    out["steps table: a wall time code out of range"] = steps(raw_table(n, {"codes": _col([10 ** 6] * n)}))
    out["steps table: a column of unknown method"] = steps(raw_table(n, {"nfe": b"\x09"}))
    out["steps table: runs that do not add up"] = steps(raw_table(n, {"nfe": b"\x04\x01\x02" + _varint(n + 3)}))
    out["steps table: trailing bytes"] = steps(raw_table(n, {}) + b"\x00")
    out["steps table: 1.x bundle in a 2.x file"] = recs[:si] + [(fmt.STEPS, fmt.encode_bundle(
        {"batch": b0, "first": 0, "n": 1}, {}))] + recs[si + 1:]
    out["steps table: a scalar of unknown type"] = steps(raw_table(n, {}, tail=scalar(5, 9, [], [0] * n)))
    out["steps table: a scalar of an unknown well-known name"] = steps(raw_table(n, {}, tail=scalar(200, 1, [], [0] * n)))
    out["steps table: a boolean scalar holding 2"] = steps(raw_table(n, {}, tail=scalar(5, records.S_BOOL, [], [2] * n)))
    out["steps table: a float32 scalar of 2^40"] = steps(raw_table(n, {}, tail=scalar(5, records.S_F32, [], [1 << 40] * n)))
    out["steps table: a scalar named twice"] = steps(raw_table(n, {}, tail=b"\x02" + scalar(5, 1, [], [0] * n)[1:-2]
                                                               + scalar(5, 1, [], [0] * n)[1:]))
    out["steps table: a block event past the table"] = steps(raw_table(n, {}, tail=b"\x00\x01" + _varint(n + 5)
                                                                       + b"\x01\x00\x00\x02\x01\x00"))
    out["steps table: a block event of an unknown kind"] = steps(raw_table(n, {}, tail=b"\x00\x01\x00\x7f"
                                                                           + b"\x00\x00\x02\x01\x00"))
    for name, fn in {
        "negative NFE": lambda h, m, a: a.update(nfe=-a["nfe"] - 1),
        "window past the canvas": lambda h, m, a: a.update(start=a["start"] + 10 ** 6),
        "event of a bad row": lambda h, m, a: m.update(events=[[0, "opened", 0, 0, 1, 99]]),
        "unknown batch": lambda h, m, a: h.update(batch=99),
        "steps not increasing": lambda h, m, a: a.update(step=np.arange(n)[::-1] + 1),
        "active holding 2": lambda h, m, a: a.update(active=a["active"].astype(np.int64) * 2),
        "JSON scalar of the wrong length": lambda h, m, a: m.update(json_scalars={"x": [1]}),
    }.items():
        out[f"steps table: {name}"] = _edit_table_v2(recs, fmt.STEPS, fn)
    out["steps: record duplicated"] = recs[:si + 1] + [recs[si]] + recs[si + 1:]
    h2, m2, a2 = table_v2(recs, si)
    a2["nfe"] = a2["nfe"] + 1
    out["steps: record duplicated with other contents"] = recs[:si + 1] + [(fmt.STEPS, table_v2_payload(
        fmt.STEPS, h2, m2, a2))] + recs[si + 1:]

    # -- batch records ------------------------------------------------------------------------------------------------
    for name, fn in {
        "more rows than batch_size": lambda m, a: m.update(rows=list(range(1000, 1000 + 64))),
        "row listed twice": lambda m, a: m.update(rows=[m["rows"][0]] * len(m["rows"])),
        "row beyond rows_expected": lambda m, a: m.update(rows=[10 ** 6] + m["rows"][1:]),
        "gen_start beyond the prompt length": lambda m, a: m.update(gen_start=1 << 30, length=(1 << 30) + 16),
        "prompt token 1e9": lambda m, a: a["prompt_tokens"].__setitem__((0, 0), 10 ** 9),
        "prompt mask holding 2": lambda m, a: a.update(prompt_mask=a["prompt_mask"].astype(np.int64) * 2),
        "mask_id outside the vocabulary": lambda m, a: m.update(mask_id=10 ** 9),
        "info a nested list": lambda m, a: m.update(info=json.loads("[" * 30 + "]" * 30)),
        "info a list": lambda m, a: m.update(info=[1, 2]),
        "rows of another batch": lambda m, a: m.update(rows=list(range(len(m["rows"])))),
    }.items():
        out[f"batch: {name}"] = _edit_batch_v2(recs, fn, which=-1 if name == "rows of another batch" else 0)
    bi = _kinds(recs, fmt.BATCH)[0]
    out["batch: unknown flags"] = _with(recs, bi, _batch_flags(recs[bi][1], 0x80))
    out["batch: trailing bytes"] = _with(recs, bi, recs[bi][1] + b"\x00")
    for depth in (100000, 10000):
        out[f"batch: info JSON nested {depth // 1000}k deep"] = _with(recs, bi, _batch_flags(
            recs[bi][1], records.B_INFO, extra=_varint(2 * depth) + b"[" * depth + b"]" * depth))

    # -- sequence records (shared layout; plus the 2.x commit-order coding) ---------------------------------------
    out.update(_seq_cases(recs, header, batch_meta["gen_start"]))
    s0 = fmt.decode_seq(recs[_kinds(recs, fmt.SEQ)[0]][1])
    L = int(s0.tokens.shape[0])
    tok = b"\x00" + ints(s0.tokens)
    order = sequence._commit_order(s0.step_of, fmt.ZSTD_LEVEL)
    assert order is not None
    ohead, vals, radix = order
    layout = seq_payload(s0.row, L, s0.nfe, s0.finish_step, 0, b"\x04" + tok)
    qi = _kinds(recs, fmt.SEQ)[0]
    out["sequence: commit order with an unknown position class"] = _with(recs, qi, layout + b"\x02" + _col([3] * L))
    out["sequence: commit order claiming 2^40 commit steps"] = _with(recs, qi, layout + b"\x02" + _col([0] * L)
                                                                     + _varint(1 << 40))
    bad = list(vals)
    bad[-1] = radix[-1]
    out["sequence: commit order rank out of range"] = _with(recs, qi, layout + b"\x03" + ohead + ints(bad))
    out["sequence: commit order with a value left over"] = _with(recs, qi, layout + b"\x02" + ohead + sequence._pack_radix(
        vals[:-1] + [vals[-1] + radix[-1] * 7], radix[:-1] + [radix[-1] * 8]))
    out["sequence: unknown step coding"] = _with(recs, qi, layout + b"\x07")
    out["sequence: unknown token coding"] = _with(recs, qi, seq_payload(s0.row, L, s0.nfe, s0.finish_step, 0, b"\x04\x07"))

    # -- rows and counts that disagree (the end digest recomputed: only cross-checks can tell) ----------------------
    out.update(_record_cases(recs))
    ends = _kinds(recs, fmt.BATCH_END)

    def edit_end(fn, which=0):
        i = ends[which]
        h, c, has = records.decode_batch_end_head(recs[i][1], check_header(header), 1 << 30)
        table = recs[i][1][c.pos:] if has else None
        fn(h)
        return _with(recs, i, records.encode_batch_end(h, table))
    out["batch-end steps wrong"] = edit_end(lambda h: h.update(steps=h["steps"] + 5))
    out["batch-end NFE wrong"] = edit_end(lambda h: h.update(nfe=h["nfe"] + 1))
    out["batch-end of another batch's rows"] = edit_end(lambda h: h.update(rows=[99]))
    out["batch-end unknown flags"] = _with(recs, ends[0], _end_flags(recs[ends[0]][1], 0x40))
    out["batch-end removed"] = [r for i, r in enumerate(recs) if i != ends[0]]
    out["batch-end table of another batch's width"] = _edit_table_v2(
        recs, fmt.BATCH_END, lambda h, m, a: a.update(active=np.ones((m["n"], B + 1), bool),
                                                     finished=np.zeros((m["n"], B + 1), bool)))
    out["end status complete, a batch unfinished"] = _edit_end_v2(
        [r for i, r in enumerate(recs) if i != ends[-1]], lambda m: m.update(unfinished_batches=[]))
    out["end lists a finished batch as unfinished"] = _edit_end_v2(recs, lambda m: m.update(unfinished_batches=[0]))
    ei = _kinds(recs, fmt.END)[0]
    out["end status code unknown"] = _with(recs, ei, b"\x09" + recs[ei][1][1:])
    out["end record trailing bytes"] = _with(recs, ei, recs[ei][1] + b"\x00")
    files = {name: assemble(r) for name, r in out.items()}
    # counts in the end record that disagree with the file (digest still matching)
    meta = records.decode_end(recs[ei][1])
    body = assemble(recs[:ei])
    meta.update(sha256_before_end=hashlib.sha256(body).hexdigest(), bytes_before_end=len(body),
                records=dict(meta["records"], sequence=meta["records"]["sequence"] + 3))
    files["end record counts wrong"] = body + fmt.frame_record(fmt.END, records.encode_end(meta, KINDS))
    return files


def _batch_flags(payload: bytes, flags: int, extra: bytes = b"") -> bytes:
    """A 2.x batch record with ``flags`` set in its flags byte and ``extra`` inserted where the info goes."""
    c = records.Cursor(payload)
    c.varint("batch")
    records.get_rows(c, 1 << 16, (1 << 24) - 1)
    for _ in range(3):
        c.varint("field")
    old = payload[c.pos]
    at = c.pos + 1 + (8 if old & records.B_RNG else 0)
    return payload[:c.pos] + bytes((old | flags,)) + payload[c.pos + 1:at] + extra + payload[at:]


def _end_flags(payload: bytes, flags: int) -> bytes:
    """A 2.x batch-end record with its flags byte replaced."""
    c = records.Cursor(payload)
    for _ in range(4):
        c.varint("field")
    return payload[:c.pos] + bytes((flags,)) + payload[c.pos + 1:]


def _record_cases(recs) -> Dict[str, List[Rec]]:
    """Records removed, duplicated, reordered or added, whatever their layout (the end digest recomputed)."""
    out: Dict[str, List[Rec]] = {}
    b_idx = _kinds(recs, fmt.BATCH)
    last_batch = [i for i in range(b_idx[-1], len(recs)) if recs[i][0] in (fmt.BATCH, fmt.STEPS, fmt.SEQ, fmt.BATCH_END)]
    out["rows removed (a whole batch), digest recomputed"] = [r for i, r in enumerate(recs) if i not in last_batch]
    seqs = _kinds(recs, fmt.SEQ)
    out["one sequence removed, digest recomputed"] = [r for i, r in enumerate(recs) if i != seqs[-1]]
    out["sequence duplicated, digest recomputed"] = recs[:seqs[0] + 1] + [recs[seqs[0]]] + recs[seqs[0] + 1:]
    out["sequences reordered, digest recomputed"] = _swap(recs, seqs[0], seqs[1])
    out["batch records reordered, digest recomputed"] = _swap(recs, b_idx[0], b_idx[1])
    out["second header"] = recs[:1] + [recs[0]] + recs[1:]
    out["record after the end record"] = recs + [recs[_kinds(recs, fmt.SEQ)[0]]]
    out["logits record of shape 2^20 x 2^20 x 2^20"] = recs[:seqs[0]] + [(fmt.LOGITS, raw_bundle(
        {"batch": 0, "step": 1, "start": 0, "shape": [1 << 20, 1 << 20, 1 << 20], "bound": 0.01, "qstep": 0.02,
         "max_error": 0.0, "nb": 1}, [["q", "u1", [1 << 20]], ["exc_index", "i8", [0]], ["exc_value", "u4", [0]]],
        1 << 20))] + recs[seqs[0]:]
    return out


def _raw_index(js: bytes) -> bytes:
    head = bytearray()
    fmt.put_varint(head, len(js))
    return fmt.zc(bytes(head) + js)


def _retype(meta, arrays) -> bytes:
    """A bundle whose b1 array holds the byte 2 (encode_bundle would refuse a uint8 array named as bool)."""
    index, blobs = [], []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        code = "b1" if name in ("active", "finished") else framing._dtype_code(a)
        index.append([name, code, list(a.shape)])
        blobs.append(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    js = json.dumps({"m": meta, "a": index}, separators=(",", ":")).encode()
    head = bytearray()
    fmt.put_varint(head, len(js))
    return fmt.zc(bytes(head) + js + b"".join(blobs))


def _swap(recs, i, j) -> List[Rec]:
    out = list(recs)
    out[i], out[j] = out[j], out[i]
    return out


# --------------------------------------------------------------------------------------------------
def flips(data: bytes, n: int, rng: np.random.Generator):
    """``n`` copies of ``data`` with one byte changed each: (offset, file)."""
    for o in rng.integers(0, len(data), size=n).tolist():
        bad = bytearray(data)
        bad[o] ^= int(rng.integers(1, 256))
        yield o, bytes(bad)


def truncations(data: bytes, n: int, rng: np.random.Generator):
    """``n`` prefixes of ``data`` (and every record boundary): (cut, file)."""
    recs, _ = scan_frames(data)
    cuts = sorted(set(rng.integers(0, len(data), size=n).tolist()) | {r.offset for r in recs})
    for c in cuts:
        yield c, data[:c]


def check_recovered(tr, reference) -> Tuple[int, int]:
    """(rows returned, wrong rows) of a recovered trace against the intact one's rows by row number."""
    ref = {s.row: s for s in reference}
    wrong = 0
    for s in tr:
        r = ref.get(s.row)
        if r is None or not (np.array_equal(s.tokens, r.tokens) and np.array_equal(s.step_of, r.step_of)
                             and s.nfe == r.nfe and np.array_equal(s.prompt_ids, r.prompt_ids)):
            wrong += 1
    return len(tr), wrong

