"""experiments/bench_trace.py's writer section: the replayed writer work it reports is a real decode's.

Its numbers are machine-dependent and not tested; what is: the section captures a real decode's hand-over, replays
it through a recorder without its thread, and prints one row per run with the batches and steps of that decode
and positive times.
"""
import re

import pytest

from conftest import load_experiment


def test_the_writer_section_replays_a_real_decode(capsys):
    mod = load_experiment("bench_trace")
    mod.bench_writer(16, reps=2, configs=(("batch 2", ["batch_size=2"]),))
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("batch 2"))
    nums = [float(x) for x in re.findall(r"[0-9]+(?:\.[0-9]+)?", row[len("batch 2"):])]
    batches, steps, per_batch, per_step = nums[:4]
    assert batches == 4 and steps >= 4 * 2          # 8 prompts in batches of 2, gen 16: some steps each
    assert per_batch > 0 and per_step > 0 and abs(per_batch * batches * 1e3 / steps - per_step) < 0.01 * per_step + 0.1
    assert len(nums) == 4 + 6


@pytest.mark.slow      # (a benchmark section: ~2 s on 2 cores)
def test_the_overhead_section_measures_the_hand_over_inside_the_decodes(capsys):
    """The recording-overhead section times the recorder's sink calls inside the real recorded decodes (not in a
    synthetic loop): positive per-step and per-batch hand-over figures, and no host read added by recording."""
    mod = load_experiment("bench_trace")
    res = mod.bench_overhead(2, 16, configs=((1, 1),))
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("CPU spent on recording"))
    m = re.search(r"hand-over ([0-9.]+) us/step \+ ([0-9.]+) us/batch", line)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, line
    assert res[1]["syncs"] == 0


def test_trace_codecs_takes_each_method_out_and_restores_the_encoder(tmp_path):
    """experiments/trace_codecs.py re-encodes a trace's sequence records without each integer stream method:
    every variant still decodes to the same rows, byte planes alone take more bytes, and the encoder is as shipped
    afterwards."""
    import numpy as np

    import trace_corpus as tc
    from dlm_engine.trace import codecs
    from dlm_engine.trace import format as fmt

    mod = load_experiment("trace_codecs")
    path = tmp_path / "t.dlmt"
    tc.record_base(path, capture="confidence")
    before = (codecs.RICE_KMAX, codecs._unary_best, codecs.zc)
    res = mod.measure(str(path))
    assert set(res) == {"none", "zstd", "bits", "rice", "all"}
    assert res["all"] > res["none"]                  # byte planes alone: larger
    assert (codecs.RICE_KMAX, codecs._unary_best, codecs.zc) == before
    from dlm_engine.trace import open_trace

    seqs = [s._data for s in open_trace(str(path))]
    with mod.without("all"):
        enc = fmt.encode_seqs(seqs)
    for s, p in zip(seqs, enc):
        back = fmt.decode_seq(p)
        assert np.array_equal(back.tokens, s.tokens) and np.array_equal(back.step_of, s.step_of)
