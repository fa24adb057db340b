"""A row finished from outside the loop between steps (the server freeing a cancelled request sets
``canvas.finished`` from a sink) sits out once the loop's next read has seen it, and the other rows decode as they
would have; the canvas keeps no host copy of its rows."""
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.core.loop import Sink, decode
from dlm_engine.core.registry import load_plugins, strategy_class

load_plugins()

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
GEN = 16


def run(model, free_after=None):
    cls = strategy_class("low_confidence")

    class Frees(Sink):
        def __init__(self):
            self.active = []

        def on_delta(self, delta, canvas):
            self.active.append(delta.active.tolist())
            if delta.step == free_after:                   # as dlm_engine/serve/engine.py frees a cancelled row
                canvas.finished[1] = True

    canvas = Canvas.from_prompts(PROMPTS, GEN, int(model.config.mask_token_id), 0)
    sink = Frees()
    torch.manual_seed(0)
    decode(model, canvas, cls(cls.Config(steps=16, block_length=8), GEN), sinks=[sink])
    return canvas, sink.active


def test_a_row_freed_between_steps_sits_out_after_the_next_read(tiny_llada):
    plain, active0 = run(tiny_llada)
    assert all(a == [True] * 3 for a in active0[:4])
    canvas, active = run(tiny_llada, free_after=2)
    assert active[2][1] and all(not a[1] for a in active[3:])     # step 3 was planned on the read before the free
    for r in (0, 2):                                              # the other rows decode as before
        assert torch.equal(canvas.tokens[r], plain.tokens[r]) and torch.equal(canvas.step_of[r], plain.step_of[r])
    assert bool(canvas.finished.all()) and int(canvas.row_nfe[1]) < int(plain.row_nfe[1])


def test_the_canvas_keeps_no_host_state(tiny_llada):
    canvas, _ = run(tiny_llada)
    assert canvas.finished.tolist() == [True] * 3
    assert not any(isinstance(v, (dict, tuple)) and v and all(isinstance(x, bool) for x in v)
                   for v in vars(canvas).values())
    assert not any(isinstance(v, dict) for v in vars(canvas).values())
