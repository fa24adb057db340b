"""Per-sequence metrics (dlm_engine.metrics): the definitions, their independence from the batch size, and the
same figures in results, traces and `dlm-trace`."""
import subprocess
import sys

import numpy as np
import pytest

from dlm_engine.metrics import batch_metrics, finish_step, sequence_metrics, totals


# ------------------------------------------------------------------------------------------- definitions
def test_forwards_after_a_sequence_finished_cost_it_nothing():
    steps = np.arange(1, 7)
    nfe = np.ones(6, int)
    active = np.ones((6, 2), bool)
    finished = np.zeros((6, 2), bool)
    # row 0 commits its last position at step 2, row 1 at step 5; the batch runs 6 steps
    step_of = np.array([[1, 2, 1, 2], [3, 5, 4, 1]])
    tokens = np.array([[7, 2, 2, 2], [7, 8, 9, 2]])  # EOS = 2
    wall = np.linspace(0.1, 0.6, 6)
    m0, m1 = batch_metrics(steps, nfe, active, finished, wall, step_of, tokens, eos_id=2)
    assert (m0.nfe, m0.finish_step, m0.generated_tokens, m0.latency) == (2, 2, 2, pytest.approx(0.2))
    assert (m1.nfe, m1.finish_step, m1.generated_tokens) == (5, 5, 4)
    assert m0.tpf == 1.0 and m1.tpf == pytest.approx(0.8)


def test_explicit_finish_and_inactive_steps():
    steps = np.array([1, 2, 3, 4])
    # finished (early exit) after step 2 with positions still masked: the explicit mark ends it
    assert finish_step(steps, np.array([0, 1, 1, 1], bool), np.array([1, -1, 2])) == 2
    # never finished and never complete (a stalled or cut-off decode): every step counts
    assert finish_step(steps, np.zeros(4, bool), np.array([1, -1, 2])) == 4
    # nothing to decode (every position given): no step is its own
    assert finish_step(steps, np.zeros(4, bool), np.array([0, 0])) == 0
    # a step the row sat out (compacted away) is not one of its forwards; a step of 2 forwards counts 2
    m = sequence_metrics(steps, [1, 2, 1, 1], [True, True, False, True], [0, 0, 0, 0], [0.1] * 4,
                         np.array([1, 4, 2]), np.array([5, 6, 7]), eos_id=None)
    assert (m.nfe, m.generated_tokens, m.finish_step) == (4, 3, 4)


def test_aggregates_are_ratios_of_totals_not_means_of_ratios():
    steps, nfe = np.array([1, 2, 3, 4]), np.ones(4, int)
    a = sequence_metrics(steps, nfe, [1, 0, 0, 0], [0] * 4, [0.0] * 4, np.array([1, 1]), np.array([4, 4]), None)
    b = sequence_metrics(steps, nfe, [1] * 4, [0] * 4, [0.0] * 4, np.array([1, 4]), np.array([4, 4]), None)
    t = totals([a, b], model_calls=4, wall_time=2.0)
    assert (a.tpf, b.tpf) == (2.0, 0.5)
    assert t.tpf == pytest.approx(4 / 5) and t.tpf != pytest.approx((a.tpf + b.tpf) / 2)
    assert (t.nfe, t.nfe_per_sequence, t.model_calls, t.tps) == (5, 2.5, 4, 2.0)
    assert t.as_dict()["model_calls"] == 4


@pytest.mark.slow
def test_metrics_module_does_not_import_torch():
    code = "import sys, dlm_engine.metrics; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------------------------------------- batch invariance
@pytest.fixture(scope="module")
def lm():
    from dlm_engine.app.api import load_directory

    return load_directory()


@pytest.fixture(scope="module")
def prompts():
    from dlm_engine.app.tasks import held_out

    return [e.prompt for e in held_out(50)]


def _decode(lm, prompts, name, cache, batch_size, **kw):
    from dlm_engine.app.api import run_prompts
    from dlm_engine.core.registry import cache_class, strategy_class

    S, C = strategy_class(name), cache_class(cache)
    return run_prompts(lm, prompts, lambda: S(S.Config(**kw), 16), lambda: C(C.Config()), 16, batch_size,
                       warmup=False)


def _figures(stats):
    # not ``steps``: the batch step after which a row finished counts the steps it sat out, too
    per_seq = [(r.nfe, r.generated_tokens, r.tpf) for r in stats.rows]
    t = stats.totals
    return per_seq, (t.nfe, t.generated_tokens, t.tpf, t.nfe_per_sequence)


@pytest.mark.slow
@pytest.mark.parametrize("name, cache, kw", [
    ("low_confidence", "none", {}),
    ("low_confidence", "none", {"block_length": 4, "steps": 8}),
    ("threshold", "none", {}),
    ("threshold", "dual", {}),
    ("factor", "none", {}),
    ("early_exit", "none", {"answer_start": 0}),
    ("cadllm", "dual", {"initial_block_length": 8, "min_block": 4, "max_block": 16}),
    ("block_buffer", "none", {"block_length": 4, "buffer_size": 2}),
    ("dream", "none", {"steps": 8}),
    # semi-autoregressive blocks: a row whose block is full sits the batch's steps out until the block moves on
    ("threshold", "dual", {"block_length": 4}),
    ("factor", "prefix", {"block_length": 8}),
    # rows at different blocks at once: the span caches recompute for each row only its own buffer (issue 47)
    ("block_buffer", "dual", {"block_length": 4, "buffer_size": 1}),
    ("block_buffer", "prefix", {"block_length": 4, "buffer_size": 2}),
])
def test_per_sequence_and_aggregate_figures_do_not_depend_on_the_batch_size(lm, prompts, name, cache, kw):
    runs = {bs: _decode(lm, prompts, name, cache, bs, **kw) for bs in (1, 8, 50)}
    one = _figures(runs[1])
    assert all(r.steps == r.nfe for r in runs[1].rows)          # alone, every step is one of its forwards
    assert any(n > 1 for n, *_ in one[0]), "the check needs sequences of several forwards"
    for bs in (8, 50):
        assert [r.tokens for r in runs[bs].rows] == [r.tokens for r in runs[1].rows], bs
        assert _figures(runs[bs]) == one, bs
    # only the batched forward count changes with the batch size (cadllm decodes one row at a time)
    assert runs[1].model_calls >= runs[8].model_calls >= runs[50].model_calls
    assert name == "cadllm" or runs[1].model_calls > runs[50].model_calls


def test_steps_scheduled_after_the_sequence_is_complete_cost_nothing(lm, prompts):
    """strategy.steps=64 over 16 positions: LLaDA's schedule commits one position per step for 16 steps and
    then runs 48 zero-transfer steps; the sequence was done at step 16."""
    stats = _decode(lm, prompts[:4], "low_confidence", "none", 4, steps=64)
    assert stats.model_calls == 64
    assert [(r.nfe, r.steps) for r in stats.rows] == [(16, 16)] * 4


# ------------------------------------------------------------------------------------------- traces
@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_trace_api_show_and_diff_report_the_same_per_sequence_figures(lm, prompts, tmp_path, capsys):
    from dlm_engine.app.api import run_prompts
    from dlm_engine.core.registry import cache_class, strategy_class
    from dlm_engine.trace import TraceRecorder, open_trace
    from dlm_engine.trace.cli import main as trace_main

    S, C = strategy_class("low_confidence"), cache_class("none")
    header = {"model": {"name": "tiny", "eos_id": lm.eos_id, "mask_id": lm.mask_id}, "config": {}}
    stats = {}
    for bs in (1, 6):
        with TraceRecorder(str(tmp_path / f"b{bs}.dlmt"), header) as rec:
            stats[bs] = run_prompts(lm, prompts[:6], lambda: S(S.Config(steps=32), 16), lambda: C(C.Config()), 16, bs,
                                    sinks_for_batch=lambda b, rows: [rec.sink(b, rows)], warmup=False)
    tr = open_trace(tmp_path / "b6.dlmt")
    for seq, row in zip(tr, stats[6].rows):
        assert (seq.nfe, seq.metrics.generated_tokens, seq.tpf) == (row.nfe, row.generated_tokens, row.tpf) == (
            16, row.generated_tokens, row.generated_tokens / 16)
        st = seq.steps  # this sequence's steps, ending at its finish (the batch ran 32)
        assert len(st) == 16 and int(st.step[-1]) == seq.metrics.finish_step == 16 and int(st.nfe.sum()) == seq.nfe
    assert tr.totals().model_calls == 32 and tr.totals().nfe == 6 * 16
    capsys.readouterr()
    assert trace_main(["show", str(tmp_path / "b6.dlmt")]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, l in enumerate(out) if l.split()[:1] == ["row"])
    assert out[head].split()[:6] == ["row", "L", "steps", "NFE", "gen", "TPF"]
    assert [l.split()[2:4] for l in out[head + 1:head + 7]] == [["16", "16"]] * 6
    assert "sequences 6  NFE/seq 16.00" in "\n".join(out) and "model calls 32" in "\n".join(out)
    # batch 1 and batch 6: the same trajectories and per-sequence figures; only the model calls differ
    assert trace_main(["diff", str(tmp_path / "b1.dlmt"), str(tmp_path / "b6.dlmt")]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("rows:"))
    assert "NFE per sequence 16.00 vs 16.00" in line and "model calls 192 vs 32" in line
