"""Hostile trace files: a generator of crafted files with valid checksums (and a recomputed end digest),
single-byte flips and truncations. Used by ``tests/test_trace_hostile.py`` and ``experiments/fuzz_trace.py``.

Every crafted file starts from a real trace (``base``) and changes what an attacker or a buggy writer could:
sizes declared by zstd frames (hand-made frames of RLE blocks: 128 KB that declare 4 GiB), JSON shapes and
nesting, integers out of range or of the wrong type, rows removed, duplicated or reordered, counts that
disagree. The record CRCs and the end record's SHA-256 are recomputed, so only the reader's validation
stands between these files and a wrong answer (or a traceback, or an exhausted memory).
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Dict, List, Tuple

import numpy as np

from dlm_engine.trace import format as fmt
from dlm_engine.trace.reader import scan_frames

Rec = Tuple[int, bytes]          # (kind, payload)


# --------------------------------------------------------------------------------------------------
# taking a file apart and putting it back together with valid checksums and digest
def parse(data: bytes) -> List[Rec]:
    recs, damage = scan_frames(data)
    assert not damage, damage
    return [(r.kind, bytes(r.payload)) for r in recs]


def assemble(recs: List[Rec], fix_end: bool = True) -> bytes:
    """Frame ``recs`` (CRCs recomputed); the end record's digest, offset and counts describe what precedes it."""
    out = bytearray(fmt.PREAMBLE)
    counts: Dict[str, int] = {}
    for kind, payload in recs:
        if kind == fmt.END and fix_end and len(payload) < 4096:   # (a crafted end record itself stays as it is)
            meta, _ = fmt.decode_bundle(payload)
            meta = dict(meta, sha256_before_end=hashlib.sha256(out).hexdigest(), bytes_before_end=len(out),
                        records={name: counts.get(name, 0) for name in fmt.KIND_NAMES.values()})
            payload = fmt.encode_bundle(meta, {})
        out += fmt.frame_record(kind, payload)
        counts[fmt.KIND_NAMES[kind]] = counts.get(fmt.KIND_NAMES[kind], 0) + 1
    return bytes(out)


def bundle(payload: bytes):
    meta, arrays = fmt.decode_bundle(payload)
    return json.loads(json.dumps(meta)), {k: np.array(v) for k, v in arrays.items()}


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


def record_base(path, capture: str = "tokens", batch_size: int = 3, prompts=PROMPTS, gen_length: int = 16) -> bytes:
    """A real trace: the seeded random tiny model, low_confidence, 3 batches; its header declares the shape."""
    import os

    import torch
    from omegaconf import OmegaConf

    from dlm_engine.app.api import load_model, run_prompts
    from dlm_engine.core.registry import STRATEGIES, cache_class, load_plugins
    from dlm_engine.trace import TraceRecorder

    load_plugins()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lm = load_model(OmegaConf.load(os.path.join(root, "conf", "model", "tiny_random.yaml")), "cpu", "float32")
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
    with TraceRecorder(str(path), header, capture=capture) as rec:
        run_prompts(lm, ids, lambda: cls(conf, gen_length), lambda: cache_class("none")(cache_class("none").Config()),
                    gen_length, batch_size, sinks_for_batch=lambda b, rows: [rec.sink(b, rows)], warmup=False)
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


def _edit_bundle(recs, kind, fn, which: int = 0) -> List[Rec]:
    i = _kinds(recs, kind)[which]
    meta, arrays = bundle(recs[i][1])
    fn(meta, arrays)
    return _with(recs, i, fmt.encode_bundle(meta, arrays))


def _edit_seq(recs, fn, which: int = 0) -> List[Rec]:
    i = _kinds(recs, fmt.SEQ)[which]
    s = fmt.decode_seq(recs[i][1])
    fn(s)
    return _with(recs, i, fmt.encode_seq(s))


def crafted(base: bytes) -> Dict[str, bytes]:
    """Every class of hostile file, by name; each has valid record checksums and a matching end digest."""
    recs = parse(base)
    header = json.loads(fmt.zd(recs[0][1]))
    first_seq = fmt.decode_seq(recs[_kinds(recs, fmt.SEQ)[0]][1])
    L = int(first_seq.tokens.shape[0])
    steps_meta, _ = bundle(recs[_kinds(recs, fmt.STEPS)[0]][1])
    batch_meta, _ = bundle(recs[_kinds(recs, fmt.BATCH)[0]][1])
    B = len(batch_meta["rows"])
    out: Dict[str, List[Rec]] = {}

    # -- decompression bombs: frames that declare far more than the record may hold ----------------------
    n = steps_meta["n"]
    out["steps bundle declaring 4 GiB"] = _with(recs, _kinds(recs, fmt.STEPS)[0], raw_bundle(
        steps_meta, [["wall_dus", "i8", [n]], ["nfe", "i4", [n]], ["start", "i4", [n]], ["width", "i4", [n]],
                     ["active", "b1", [n, B]], ["finished", "b1", [n, B]], ["s:x", "f8", [n, (1 << 29) // n]]],
        8 * n + 12 * n + 2 * n * B + 8 * n * ((1 << 29) // n)))
    out["batch bundle declaring 1 GiB of prompt"] = _with(recs, _kinds(recs, fmt.BATCH)[0], raw_bundle(
        dict(batch_meta, gen_start=1 << 27), [["prompt_tokens", "i8", [B, 1 << 27]], ["prompt_mask", "b1", [B, 1 << 27]]],
        9 * B * (1 << 27)))
    out["end bundle declaring 2 GiB"] = _with(recs, _kinds(recs, fmt.END)[0], raw_bundle(
        bundle(recs[_kinds(recs, fmt.END)[0]][1])[0], [["pad", "u1", [1 << 31]]], 1 << 31))
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

    # -- JSON: nesting, size, wrong shapes and types -------------------------------------------------------
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
    out["bundle index nested 100k deep"] = _with(recs, _kinds(recs, fmt.STEPS)[0], _raw_index(b"[" * 100000 + b"]" * 100000))
    out["bundle index is a list"] = _with(recs, _kinds(recs, fmt.STEPS)[0], _raw_index(b"[1]"))
    out["bundle array of unknown dtype"] = _with(recs, _kinds(recs, fmt.STEPS)[0], _raw_index(
        json.dumps({"m": steps_meta, "a": [["x", "q9", [1]]]}).encode()))
    out["bundle array of negative shape"] = _with(recs, _kinds(recs, fmt.STEPS)[0], _raw_index(
        json.dumps({"m": steps_meta, "a": [["x", "u1", [-1]]]}).encode()))
    out["bundle array of shape 1e12 x 1e12"] = _with(recs, _kinds(recs, fmt.STEPS)[0], _raw_index(
        json.dumps({"m": steps_meta, "a": [["x", "f8", [10 ** 12, 10 ** 12]]]}).encode()))

    # -- step records ---------------------------------------------------------------------------------------
    for name, fn in {
        "step0 1e20": lambda m, a: m.update(step0=10 ** 20),
        "step0 1e400": lambda m, a: m.update(step0=float("inf")),
        "step0 a string": lambda m, a: m.update(step0="1"),
        "n 1e12": lambda m, a: m.update(n=10 ** 12),
        "negative NFE": lambda m, a: a.update(nfe=-a["nfe"]),
        "negative wall time": lambda m, a: a.update(wall_dus=-a["wall_dus"] - 1),
        "window past the canvas": lambda m, a: a.update(start=a["start"] + 10 ** 6),
        "active of the wrong shape": lambda m, a: a.update(active=a["active"][:, :1]),
        "event of a bad row": lambda m, a: m.update(events=[[0, "opened", 0, 0, 1, 99]]),
        "event that is a string": lambda m, a: m.update(events=["opened"]),
        "scalar of the wrong length": lambda m, a: m.update(json_scalars={"x": [1]}),
        "unknown batch": lambda m, a: m.update(batch=99),
        "batch index NaN": lambda m, a: m.update(batch=float("nan")),
    }.items():
        out[f"steps: {name}"] = _edit_bundle(recs, fmt.STEPS, fn)
    i = _kinds(recs, fmt.STEPS)[0]
    meta, arrays = bundle(recs[i][1])
    out["steps: boolean array holding 2"] = _with(recs, i, _retype(
        meta, dict(arrays, finished=np.full(arrays["finished"].shape, 2, np.uint8))))
    out["steps: record duplicated"] = recs[:i + 1] + [recs[i]] + recs[i + 1:]
    meta, arrays = bundle(recs[i][1])
    arrays["nfe"] = arrays["nfe"] + 1
    out["steps: record duplicated with other contents"] = recs[:i + 1] + [(fmt.STEPS, fmt.encode_bundle(meta, arrays))] \
        + recs[i + 1:]

    # -- batch records ----------------------------------------------------------------------------------------
    for name, fn in {
        "more rows than batch_size": lambda m, a: m.update(rows=list(range(1000, 1000 + 64))),
        "row listed twice": lambda m, a: m.update(rows=[m["rows"][0]] * len(m["rows"])),
        "row beyond rows_expected": lambda m, a: m.update(rows=[10 ** 6] + m["rows"][1:]),
        "length 2^40": lambda m, a: m.update(length=1 << 40),
        "gen_start beyond the prompt length": lambda m, a: m.update(gen_start=1 << 30),
        "prompt token 1e9": lambda m, a: a["prompt_tokens"].__setitem__((0, 0), 10 ** 9),
        "mask_id a float": lambda m, a: m.update(mask_id=3.0),
        "rows of another batch": lambda m, a: m.update(rows=list(range(len(m["rows"])))),
    }.items():
        out[f"batch: {name}"] = _edit_bundle(recs, fmt.BATCH, fn, which=-1 if name == "rows of another batch" else 0)

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
        "col": np.array([batch_meta["gen_start"]]), "token": np.array([1]), "start": np.array([3]), "end": np.array([1]),
        "confidence": np.array([0.5])}))
    out["sequence: unknown flags"] = _with(recs, _kinds(recs, fmt.SEQ)[0], seq_payload(row0, L, 1, -1, 64, b""))
    out["sequence: NFE above its batch's model calls"] = _edit_seq(recs, lambda s: setattr(s, "nfe", 10 ** 6))
    out["sequence: top-k table the capture level has not"] = _edit_seq(recs, lambda s: (
        setattr(s, "topk_ids", np.zeros((int((s.step_of >= 1).sum()), 2), np.int64)),
        setattr(s, "topk_logits", np.zeros((int((s.step_of >= 1).sum()), 2), np.float32))))

    # -- rows and counts that disagree (the end digest recomputed: only cross-checks can tell) -----------------
    b_idx = _kinds(recs, fmt.BATCH)
    last_batch = [i for i in range(b_idx[-1], len(recs)) if recs[i][0] in (fmt.BATCH, fmt.STEPS, fmt.SEQ, fmt.BATCH_END)]
    out["rows removed (a whole batch), digest recomputed"] = [r for i, r in enumerate(recs) if i not in last_batch]
    seqs = _kinds(recs, fmt.SEQ)
    out["one sequence removed, digest recomputed"] = [r for i, r in enumerate(recs) if i != seqs[-1]]
    out["sequence duplicated, digest recomputed"] = recs[:seqs[0] + 1] + [recs[seqs[0]]] + recs[seqs[0] + 1:]
    out["sequences reordered, digest recomputed"] = _swap(recs, seqs[0], seqs[1])
    out["batch records reordered, digest recomputed"] = _swap(recs, b_idx[0], b_idx[1])
    out["batch-end steps wrong"] = _edit_bundle(recs, fmt.BATCH_END, lambda m, a: m.update(steps=m["steps"] + 5))
    out["batch-end NFE wrong"] = _edit_bundle(recs, fmt.BATCH_END, lambda m, a: m.update(nfe=m["nfe"] + 1))
    out["batch-end of another batch's rows"] = _edit_bundle(recs, fmt.BATCH_END, lambda m, a: m.update(rows=[99]))
    out["batch-end removed"] = [r for i, r in enumerate(recs) if i != _kinds(recs, fmt.BATCH_END)[0]]
    out["end status complete, a batch unfinished"] = _edit_bundle(
        [r for i, r in enumerate(recs) if i != _kinds(recs, fmt.BATCH_END)[-1]], fmt.END,
        lambda m, a: m.update(unfinished_batches=[]))
    out["end unfinished_batches of strings"] = _edit_bundle(recs, fmt.END, lambda m, a: m.update(unfinished_batches=["x", 1]))
    out["second header"] = recs[:1] + [recs[0]] + recs[1:]
    out["record after the end record"] = recs + [recs[_kinds(recs, fmt.SEQ)[0]]]
    out["logits record of shape 2^20 x 2^20 x 2^20"] = recs[:seqs[0]] + [(fmt.LOGITS, raw_bundle(
        {"batch": 0, "step": 1, "start": 0, "shape": [1 << 20, 1 << 20, 1 << 20], "bound": 0.01, "qstep": 0.02,
         "max_error": 0.0, "nb": 1}, [["q", "u1", [1 << 20]], ["exc_index", "i8", [0]], ["exc_value", "u4", [0]]],
        1 << 20))] + recs[seqs[0]:]
    files = {name: assemble(r) for name, r in out.items()}
    # counts in the end record that disagree with the file (digest still matching)
    e = _kinds(recs, fmt.END)[0]
    meta, _ = bundle(recs[e][1])
    body = assemble(recs[:e])
    meta.update(sha256_before_end=hashlib.sha256(body).hexdigest(), bytes_before_end=len(body),
                records=dict(meta["records"], sequence=meta["records"]["sequence"] + 3))
    files["end record counts wrong"] = body + fmt.frame_record(fmt.END, fmt.encode_bundle(meta, {}))
    return files


def _raw_index(js: bytes) -> bytes:
    head = bytearray()
    fmt.put_varint(head, len(js))
    return fmt.zc(bytes(head) + js)


def _retype(meta, arrays) -> bytes:
    """A bundle whose b1 array holds the byte 2 (encode_bundle would refuse a uint8 array named as bool)."""
    index, blobs = [], []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        code = "b1" if name in ("active", "finished") else fmt._dtype_code(a)
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

