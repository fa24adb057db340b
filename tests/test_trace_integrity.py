"""Trust the file: corruption fuzzing, truncation recovery, backpressure, writer failures, interruptions."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import struct  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from dlm_engine.app.api import load_model, run_prompts  # noqa: E402
from dlm_engine.core.loop import Sink  # noqa: E402
from dlm_engine.core.registry import STRATEGIES, cache_class, load_plugins  # noqa: E402
from dlm_engine.trace import TraceError, TraceRecorder, loads, open_trace  # noqa: E402
from dlm_engine.trace import format as fmt  # noqa: E402
from dlm_engine.trace.reader import scan_records  # noqa: E402
from dlm_engine.trace.recorder import TraceRecorder as _Rec  # noqa: E402
from dlm_engine.trace.tools import verify_integrity  # noqa: E402

load_plugins()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = {"model": {"eos_id": 2, "mask_id": 3}, "tokenizer": {"kind": "char"}, "rows_expected": 5}
PROMPTS = ["347+085=", "hi", "name a fruit:", "sum 9:", "x"]


@pytest.fixture(scope="module")
def lm():
    from dlm_engine.app.config import model_preset

    mc = model_preset("tiny_random")
    return load_model(mc, "cpu", "float32")


def _strategy():
    cls = STRATEGIES["low_confidence"]
    conf = cls.Config(steps=8, block_length=8)
    return lambda: cls(conf, 16)


def _cache():
    return cache_class("none")(cache_class("none").Config())


def record(lm, path, extra_sinks=None, batch_size=2, **kw):
    def sinks(b, rows):
        return [rec.sink(b, rows)] + (extra_sinks(b) if extra_sinks else [])

    torch.manual_seed(0)
    rec = TraceRecorder(str(path), HEADER, **kw)
    with rec:
        stats = run_prompts(lm, [lm.encode(p) for p in PROMPTS], _strategy(), _cache, 16, batch_size,
                            sinks_for_batch=sinks, warmup=False)
    return stats, rec


@pytest.fixture(scope="module")
def trace_bytes(lm, tmp_path_factory):
    p = tmp_path_factory.mktemp("tr") / "t.dlmt"
    stats, _ = record(lm, p, capture="confidence")
    return p.read_bytes(), stats


def test_intact_file_checks_out(trace_bytes):
    data, stats = trace_bytes
    tr = loads(data, recover=False)
    info = verify_integrity(tr)
    assert info["sequences"] == len(PROMPTS) and tr.ok
    assert [s.tokens.tolist() for s in tr] == [r.tokens for r in stats.rows]


def test_every_single_byte_flip_is_detected(trace_bytes):
    data, _ = trace_bytes
    rng = np.random.default_rng(1234)
    offsets = rng.integers(0, len(data), size=420)
    missed = []
    for o in offsets.tolist():
        bad = bytearray(data)
        bad[o] ^= int(rng.integers(1, 256))
        try:
            verify_integrity(loads(bytes(bad), recover=False))
        except TraceError:
            continue
        missed.append(o)
    assert not missed, f"{len(missed)} of {len(offsets)} flips accepted silently (offsets {missed[:10]})"


def test_truncation_recovers_every_complete_record(trace_bytes):
    data, stats = trace_bytes
    recs, problem = scan_records(data)
    assert problem is None
    H = fmt.REC_HEAD.size
    header_end = recs[0].offset + H + len(recs[0].payload)
    seq_ends = [(r.offset + H + len(r.payload)) for r in recs if r.kind == fmt.SEQ]
    full = [s.tokens.tolist() for s in loads(data)]
    rng = np.random.default_rng(7)
    cuts = sorted(set(rng.integers(0, len(data), size=80).tolist()) | {r.offset for r in recs} | {len(data) - 1})
    for cut in cuts:
        part = data[:cut]
        if cut < header_end:
            with pytest.raises(TraceError):
                loads(part)
            continue
        tr = loads(part, recover=True)
        expect = sum(e <= cut for e in seq_ends)
        assert len(tr) == expect, cut
        assert [s.tokens.tolist() for s in tr] == full[:expect]
        assert tr.problems and not tr.ok          # the loss is reported ...
        with pytest.raises(TraceError):           # ... and a strict reader refuses the file
            loads(part, recover=False)
        if expect < len(PROMPTS):
            assert any("lost" in p or "truncated" in p or "incomplete" in p for p in tr.problems)


def test_wrong_version_bad_magic_and_empty(trace_bytes, tmp_path):
    data, _ = trace_bytes
    newer = data[:8] + struct.pack("<HH", fmt.VERSION[0] + 1, 0) + data[12:]
    with pytest.raises(TraceError, match=f"unsupported trace format version {fmt.VERSION[0] + 1}.0 "
                                         r"\(this dlm_engine reads 2.x\)"):
        loads(newer)
    with pytest.raises(TraceError, match="not a dlm_engine trace"):
        loads(b"PK\x03\x04" + data[4:])
    with pytest.raises(TraceError, match="truncated"):
        loads(b"")
    with pytest.raises(TraceError, match="no such file"):
        open_trace(tmp_path / "missing.dlmt")


def test_reordered_records_are_detected(trace_bytes):
    data, _ = trace_bytes
    recs, _ = scan_records(data)
    H = fmt.REC_HEAD.size
    seqs = [r for r in recs if r.kind == fmt.SEQ]
    a, b = seqs[0], seqs[1]
    ra = data[a.offset:a.offset + H + len(a.payload)]
    rb = data[b.offset:b.offset + H + len(b.payload)]
    assert a.offset + len(ra) == b.offset
    swapped = data[:a.offset] + rb + ra + data[b.offset + len(rb):]
    with pytest.raises(TraceError):
        verify_integrity(loads(swapped, recover=False))


def test_full_queue_blocks_and_loses_nothing(lm, tmp_path, monkeypatch):
    orig = _Rec._handle

    def slow(self, item):
        time.sleep(0.003)
        return orig(self, item)

    monkeypatch.setattr(_Rec, "_handle", slow)
    counts = {}

    class Count(Sink):
        def __init__(self, b):
            self.b = b

        def on_delta(self, delta, canvas):
            counts[self.b] = counts.get(self.b, 0) + 1

    stats, rec = record(lm, tmp_path / "q.dlmt", extra_sinks=lambda b: [Count(b)], queue_size=1)
    assert rec.blocked_puts > 0
    tr = open_trace(tmp_path / "q.dlmt", recover=False)
    assert tr.end["queue"]["blocked_puts"] == rec.blocked_puts
    assert {b: len(tr.batches[b].steps) for b in tr.batches} == counts
    assert [s.tokens.tolist() for s in tr] == [r.tokens for r in stats.rows]


def test_writer_failure_is_never_silent(lm, tmp_path, monkeypatch):
    orig = _Rec._write_raw

    def broken(self, b):
        if self.records[fmt.HEADER]:        # the header got out; the disk fills up afterwards
            raise OSError("No space left on device")
        return orig(self, b)

    monkeypatch.setattr(_Rec, "_write_raw", broken)
    with pytest.raises(TraceError, match="No space left"):
        record(lm, tmp_path / "f.dlmt")
    assert not (tmp_path / "f.dlmt").exists()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_run_leaves_a_flushed_partial_trace(lm, tmp_path, exc):
    class Boom(Sink):
        def __init__(self, b):
            self.b = b

        def on_delta(self, delta, canvas):
            if self.b == 1 and delta.step == 3:
                raise exc("stop")

    with pytest.raises(exc):
        record(lm, tmp_path / "i.dlmt", extra_sinks=lambda b: [Boom(b)])
    assert not (tmp_path / "i.dlmt").exists()          # nothing that looks complete
    tr = open_trace(tmp_path / "i.dlmt.partial")
    assert tr.status == ("interrupted" if exc is KeyboardInterrupt else "failed: RuntimeError: stop")
    assert [s.row for s in tr] == [0, 1]               # batch 0 complete
    assert len(tr.batches[1].steps) == 3               # batch 1's steps were flushed, its sequences lost
    assert any("batch 1" in p for p in tr.problems) and any("3 of 5 rows" in p for p in tr.problems)
    with pytest.raises(TraceError):
        verify_integrity(tr)
