"""early_exit (Prophet): equivalence with LLaDA when the test is off, per-row exit in batches,
phase thresholds, scalars, constraints through the normal decode path, validation."""
import pytest
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.errors import ConfigError
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import strategy_class
from dlm_engine.app.sinks import RecordingSink

PROMPTS = [[735, 559, 771, 678, 375, 377], [127, 157, 983, 804, 991, 537, 902, 490, 136, 103, 962], [413, 750, 0]]
EE = strategy_class("early_exit")


def _run(model, name, prompts, gen=16, seed=None, **kw):
    cls = strategy_class(name)
    canvas = Canvas.from_prompts(prompts, gen, 1000, 1001)
    rec = RecordingSink()
    if seed is not None:
        torch.manual_seed(seed)
    decode(model, canvas, cls(cls.Config(**kw), gen), sinks=[rec])
    return canvas, rec


@pytest.mark.parametrize("kw", [dict(steps=16, block_length=4), dict(steps=8, block_length=8, cfg_scale=1.0),
                                dict(steps=16, block_length=8, temperature=0.7, remasking="random")])
def test_without_answer_window_it_is_llada(tiny_llada, kw):
    a, _ = _run(tiny_llada, "early_exit", PROMPTS[:1], seed=2, **kw)
    b, _ = _run(tiny_llada, "low_confidence", PROMPTS[:1], seed=2, **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.step_of, b.step_of) and a.nfe == b.nfe


def test_phase_thresholds_follow_global_step_over_steps():
    s = EE(EE.Config(steps=100, block_length=None, answer_start=0), 100)
    got = [s.phase_threshold(t) for t in (1, 32, 33, 66, 67, 100)]
    assert got == [7.5, 7.5, 5.0, 5.0, 2.5, 2.5]


def test_scalars_and_all_in_commit(tiny_llada):
    canvas, rec = _run(tiny_llada, "early_exit", PROMPTS[:1], gen=32, steps=32, block_length=8, answer_start=20,
                       early_threshold=4.0, mid_threshold=3.0, late_threshold=2.0)
    last = rec.deltas[-1]
    assert canvas.nfe == len(rec.deltas) < 8 and bool(last.scalars["exit"][0])
    assert not canvas.masked().any() and bool(last.finished[0])
    for d in rec.deltas:
        assert d.scalars["gap"].dtype == torch.float64 and d.scalars["gap"].shape == (1,)
        assert d.scalars["exit_threshold"] == 4.0                 # step / 32 < 0.33: early phase
        assert bool(d.scalars["exit"][0]) == (float(d.scalars["gap"][0]) >= d.scalars["exit_threshold"])
    # all-in: the exit step commits every remaining position, later blocks included
    g = canvas.gen_start
    assert int(last.commit.sum()) > 8 and int((canvas.step_of[0, g:] == canvas.step).sum()) == int(last.commit.sum())
    assert torch.equal(last.tokens[last.commit], canvas.tokens[:, g:][last.commit])


def test_batched_exit_is_per_row(tiny_llada):
    kw = dict(steps=16, block_length=4, answer_start=10, early_threshold=4.0, mid_threshold=3.0, late_threshold=2.0)
    alone = [_run(tiny_llada, "early_exit", [p], **kw) for p in PROMPTS]
    nfe = [c.nfe for c, _ in alone]
    assert len(set(nfe)) > 1, nfe                    # the rows exit at different steps
    canvas, rec = _run(tiny_llada, "early_exit", PROMPTS, **kw)
    g = canvas.gen_start
    assert canvas.nfe == max(nfe)
    for r, (c1, _) in enumerate(alone):
        assert torch.equal(canvas.tokens[r, g:], c1.tokens[0, c1.gen_start:])
        assert int(canvas.row_nfe[r]) == c1.nfe
        fired = [d.step for d in rec.deltas if bool(d.scalars["exit"][r])]
        assert len(fired) <= 1
        if fired:
            assert bool(rec.deltas[fired[0] - 1].finished[r])
            later = rec.deltas[fired[0]:]
            assert all(not bool(d.commit[r].any()) and not bool(d.active[r]) for d in later)


def test_constraints_are_written_by_the_strategy_and_count_as_given(tiny_llada):
    cons = {0: 5, 7: 6}
    canvas, rec = _run(tiny_llada, "early_exit", PROMPTS[:2], steps=16, block_length=8, constraints=[[0, 5], [7, 6]],
                       cfg_scale=1.0)
    g = canvas.gen_start
    setup, steps = rec.deltas[0], rec.deltas[1:]
    assert setup.step == 0 and setup.nfe == 0                  # the constraints arrive as the step-0 delta
    for p, t in cons.items():
        assert canvas.tokens[:, g + p].tolist() == [t, t] and canvas.step_of[:, g + p].tolist() == [0, 0]
        assert setup.commit[:, p].all() and setup.tokens[:, p].tolist() == [t, t]
        col = g + p
        assert not any(bool(d.commit[:, col - d.start].any()) for d in steps if d.start <= col < d.start + d.width)
    # they reduce the block's mask count: 8 masks per block minus one constraint each -> 15 commits in total
    assert int(sum(d.commit.sum() for d in steps)) == 2 * 14


def test_reference_arguments_map_absolute_positions(parity):
    """The parity adapter (not the strategy) turns Prophet's absolute answer_start_pos into an offset."""
    def conf(**kw):
        return parity.setup_for({"id": "prophet/x", "function": "generate", "prompt_len": 6,
                                 "kwargs": dict(kw, gen_length=32)}).config

    c = conf(steps=32, block_length=8, analyze_gap=True, answer_start_pos=26, early_exit_thresholds={"mid": 3.0})
    assert (c.answer_start, c.early_threshold, c.mid_threshold, c.late_threshold) == (20, 7.5, 3.0, 2.5)
    assert conf(steps=32, answer_start_pos=26).answer_start is None          # analyze_gap=False: no exit test
    assert conf(analyze_gap=True, answer_start_pos=60).answer_start is None  # window outside the generation


@pytest.mark.parametrize("kw, key", [
    (dict(answer_start=16), "strategy.answer_start=16"),
    (dict(answer_start=-5), "strategy.answer_start=-5"),
    (dict(constraints=[[16, 3]]), "strategy.constraints"),
    (dict(constraints=[[1, 2, 3]]), "strategy.constraints"),
    (dict(steps=6, block_length=4), "strategy.steps=6"),
    (dict(answer_length=0), "strategy.answer_length=0"),
    (dict(cfg_scale=-1.0), "strategy.cfg_scale"),
])
def test_bad_values_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        EE(EE.Config(**kw), 16)
