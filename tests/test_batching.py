"""Left-padded batches: each row of a batched decode equals that row decoded alone."""
import pytest
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import strategy_class

PROMPTS = [[735, 559, 771, 678, 375, 377], [127, 157, 983, 804, 991, 537, 902, 490, 136, 103, 962], [413, 750, 0]]


def _decode(model, prompts, conf, seed=None):
    strat = strategy_class("low_confidence")(conf, 16)
    canvas = Canvas.from_prompts(prompts, 16, 1000, 1001)
    if seed is not None:
        torch.manual_seed(seed)
    decode(model, canvas, strat)
    g = canvas.gen_start
    return canvas.tokens[:, g:], canvas.step_of[:, g:], canvas


@pytest.mark.parametrize("kw", [dict(steps=8, block_length=4), dict(steps=16, block_length=16, confidence="margin"),
                                dict(steps=8, block_length=8, loop="fastdllm")])
def test_batched_rows_equal_rows_alone(tiny_llada, kw):
    conf = strategy_class("low_confidence").Config(**kw)
    toks, steps, canvas = _decode(tiny_llada, PROMPTS, conf)
    assert canvas.is_padded
    for r, p in enumerate(PROMPTS):
        t1, s1, _ = _decode(tiny_llada, [p], conf)
        assert torch.equal(toks[r], t1[0])
        assert torch.equal(steps[r], s1[0])


def test_canvas_state_at_reconstructs_every_step(tiny_llada):
    from dlm_engine.app.sinks import RecordingSink

    conf = strategy_class("low_confidence").Config(steps=8, block_length=8)
    strat = strategy_class("low_confidence")(conf, 16)
    canvas = Canvas.from_prompts(PROMPTS, 16, 1000, 1001)
    rec = RecordingSink()
    decode(tiny_llada, canvas, strat, sinks=[rec])
    assert len(rec.deltas) == 8 and all(d.nfe == 1 for d in rec.deltas)
    for t, seen in enumerate(rec.states, start=1):
        assert torch.equal(canvas.state_at(t), seen)
    assert bool(rec.deltas[-1].finished.all())
    assert not canvas.masked().any()
