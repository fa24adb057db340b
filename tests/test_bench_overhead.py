"""experiments/bench_overhead.py's measuring harness: what it counts is what a decode does, recorder included.

The benchmark's numbers are not tested (they are machine-dependent); its bookkeeping is: a ``--record`` run hands
every delta to a trace recorder (a complete, readable trace with the decode's tokens), times that hand-over as
the ``sinks`` section, adds no host read, and leaves no file behind.
"""
import os

import pytest

from conftest import load_experiment
from dlm_engine.trace import format as fmt



@pytest.fixture(scope="module")
def bench():
    return load_experiment("bench_overhead")


@pytest.fixture(scope="module")
def tiny(bench):
    label, model, gen, block, prompts, budget = bench.models("tiny")[0]
    return model, gen, block, prompts[:3]


def test_record_times_the_hand_over_and_adds_no_host_read(bench, tiny, monkeypatch):
    model, gen, block, prompts = tiny
    kw = {"block_length": block}
    plain = bench.one(model, prompts, gen, "threshold", kw, "none", 1)
    plain_tokens = bench.one.tokens
    made = []
    opened = bench.open_recorder

    def spy(*args):
        rec = opened(*args)
        made.append(rec)
        return rec

    monkeypatch.setattr(bench, "open_recorder", spy)
    rec_run = bench.one(model, prompts, gen, "threshold", kw, "none", 1, record=True)
    cpu, mcpu, steps, syncs, sections, decodes, ops = rec_run
    assert bench.one.tokens == plain_tokens                    # recording changes no decision
    assert steps == plain[2] and decodes == plain[5] == len(prompts)
    assert syncs == plain[3]                                   # the hand-over reads nothing from the device
    assert "sinks" not in plain[4] and sections.get("sinks", 0.0) > 0.0
    (rec,) = made
    assert rec.status == "complete" and rec.records[fmt.BATCH] == len(prompts)   # one batch record per decode
    assert not os.path.exists(os.path.dirname(rec.path))         # the temporary trace is gone


def test_recorded_trace_holds_the_decodes(bench, tiny, monkeypatch):
    from dlm_engine.trace.reader import open_trace

    model, gen, block, prompts = tiny
    kept = {}
    opened = bench.open_recorder

    def keep(*args):
        rec = opened(*args)
        close = rec.close

        def close_and_read(*a, **k):
            digest = close(*a, **k)
            kept["trace"] = open_trace(rec.path, recover=False)
            return digest

        rec.close = close_and_read
        return rec

    monkeypatch.setattr(bench, "open_recorder", keep)
    bench.one(model, prompts, gen, "low_confidence", {"block_length": block}, "none", 1, instrument=(), record=True)
    tr = kept["trace"]
    finals = [t[0] for t in bench.one.tokens]                  # one row per decode
    assert len(tr) == len(prompts)
    for seq, row in zip(sorted(tr, key=lambda s: s.row), finals):
        assert seq.tokens.tolist() == row[len(row) - gen:]


def test_replayed_forwards_with_eviction_make_the_recorded_decodes(bench, tiny):
    """``--replayed --evict-mb``: the replayed decodes (with a buffer streamed through the caches before each forward)
    make the tokens of the run that recorded the forwards, and the eviction pass is timed as the model's."""
    model, gen, block, prompts = tiny
    us, same = bench.replayed_loop_us(model, prompts[:2], gen, "low_confidence", {"block_length": block}, 1, 1,
                                      evict_mb=1)
    assert same and us > 0
    rep = bench.ReplayedForwards(model, evict_mb=1)
    before = rep.evict.clone()
    bench.one(rep, prompts[:1], gen, "low_confidence", {"block_length": block}, "none", 1, instrument=())
    assert rep.evict.numel() == 1 << 18 and bool((rep.evict > before).all())     # touched at every forward


@pytest.mark.parametrize("kind", ["sleep", "spin"])
def test_replayed_forwards_with_time_between_make_the_recorded_decodes_and_time_it_as_the_model(bench, tiny, kind):
    """``--replayed --between KIND:MS``: the replayed decodes (the thread sleeping or spinning before each forward)
    make the tokens of the run that recorded the forwards, and that time is the model's, not the loop's."""
    import time

    model, gen, block, prompts = tiny
    kw = {"block_length": block}
    us, same = bench.replayed_loop_us(model, prompts[:2], gen, "low_confidence", kw, 1, 1, between=(kind, 0.5))
    assert same and us > 0
    rep = bench.ReplayedForwards(model, between=(kind, 3.0))
    bench.one(rep, prompts[:1], gen, "low_confidence", kw, "none", 1, instrument=())      # records the forwards
    w0 = time.perf_counter()
    cpu, mcpu, steps = bench.one(rep, prompts[:1], gen, "low_confidence", kw, "none", 1, instrument=())[:3]
    assert steps > 0 and time.perf_counter() - w0 >= steps * 3e-3          # every forward waited 3 ms
    if kind == "spin":     # CPU time, not wall: on a loaded machine a spinning thread gets only part of its 3 ms
        assert mcpu > cpu - mcpu                   # on the model's clock ...
    assert cpu - mcpu < 0.5 * steps * 3e-3         # ... and never on the loop's


@pytest.mark.parametrize("argv, key", [(["--evict-mb", "8"], "--replayed"), (["--replayed", "--evict-mb", "-1"], "--evict-mb"),
                                       (["--between", "sleep:2"], "--replayed"),
                                       (["--replayed", "--between", "spin:-1"], "--between"),
                                       (["--replayed", "--between", "nap:2"], "--between"),
                                       (["--replayed", "--between", "sleep"], "--between")])
def test_replayed_options_without_replayed_or_malformed_are_a_one_line_error(bench, argv, key, capsys):
    """``--evict-mb`` and ``--between`` measure the replayed loop: without ``--replayed``, negative or malformed,
    a one-line usage error naming the option."""
    with pytest.raises(SystemExit) as exc:
        bench.main(argv + ["--model", "tiny", "--only", "low_conf"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert key in err[-1] and "Traceback" not in "\n".join(err)


def test_op_profile_names_the_framework_line_of_every_op_outside_the_model(bench, tiny):
    """``OpProfile`` counts what ``SyncCounter.ops`` counts (the ops outside the model) and attributes each to a line
    of the framework's own code; the forward's ops are left out; the table lists the costliest first."""
    import torch

    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.instrument import ModelTimer, OpProfile, SyncCounter
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import cache_class, strategy_class

    model, gen, block, prompts = tiny
    cls = strategy_class("low_confidence")
    timer = ModelTimer(model)
    canvas = Canvas.from_prompts(prompts[:1], gen, int(model.config.mask_token_id), 0)
    with torch.inference_mode(), SyncCounter(timer) as sc, OpProfile(timer) as prof:
        decode(timer, canvas, cls(cls.Config(block_length=block), gen), cache_class("none")())
    assert timer.calls == canvas.nfe > 0
    assert prof.count == sc.ops > 0
    lines = {line for (_, line) in prof.ops}
    assert all(line.split("/")[0] in ("dlm_engine", "strategies", "cache") for line in lines), lines
    assert not any(line.startswith("dlm_engine/models/") for line in lines)     # the forward's own ops
    assert any(op.startswith("aten.softmax") and line.startswith("dlm_engine/core/sampler.py:")
               for (op, line) in prof.ops)                                       # the confidence's softmax
    table = prof.table(canvas.step, 3)
    us = [float(row.split()[0]) for row in table]
    assert len(table) == 3 and us == sorted(us, reverse=True)


def test_ops_detail_prints_the_costliest_ops_under_each_row(bench, capsys):
    bench.main(["--model", "tiny", "--batches", "1", "--prompts", "1", "--repeats", "1", "--only", "low_conf",
                "--ops-detail", "2"])
    out = capsys.readouterr().out.splitlines()
    rows = [i for i, line in enumerate(out) if line.startswith("low_conf")]
    assert len(rows) == 2                                          # caches none and dual
    for i in rows:
        detail = out[i + 1:i + 3]
        assert all(line.startswith("    ") and " aten." in line and ".py:" in line for line in detail), detail
    with pytest.raises(SystemExit) as exc:
        bench.main(["--model", "tiny", "--only", "low_conf", "--ops-detail", "-1"])
    assert exc.value.code == 2 and "--ops-detail" in capsys.readouterr().err.strip().splitlines()[-1]


def test_main_sums_up_the_budgets(bench, capsys):
    """Under each model's table: how many batch-1 rows meet the overhead budget (the others named), which rows
    take at most two steps a decode (their figure is mostly the decode's fixed cost), and the sync budget."""
    assert bench.main(["--model", "tiny", "--batches", "1", "--prompts", "2", "--repeats", "1",
                       "--only", "threshold"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("batch 1 within the 10% budget: "))
    kept, rows = (int(v) for v in line.split(": ")[1].split(" rows")[0].split(" of "))
    assert rows == 2 and 0 <= kept <= 2 and (kept == 2) == ("over:" not in line)
    assert "at most 2 steps a decode here" in out and "threshold" in out.split("at most 2 steps a decode here")[1]
    assert "sync budget: every row ok" in out
