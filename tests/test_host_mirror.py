"""The host mirror of a canvas belongs to the step loop (``core/fast/mirror.py: HostMirror``), not to ``Canvas``:
the loop makes one per decode, hands its finished rows to ``select`` (``Proposal.finished_host``) and detaches it at
the end; code outside the loop that finishes rows between steps (the server freeing a cancelled request) sets
``canvas.finished`` and tells the running decode's mirror (``live_mirror(canvas).add``)."""
import pytest
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.core.fast.mirror import live_mirror
from dlm_engine.core.loop import Sink, decode
from dlm_engine.core.registry import load_plugins, strategy_class

load_plugins()

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
GEN = 16


def run(model, free_after=None, fail_at=None, made=None):
    """low_confidence (LLaDA's schedule, finished rows told on the host) on three rows; ``free_after``: a sink frees
    row 1 after that step, as the server does; returns the canvas, the ``Proposal.finished_host`` of every step
    and the deltas' active rows."""
    cls = strategy_class("low_confidence")
    seen = []

    class Recorded(cls):
        def select(self, canvas, plan, proposal, st):
            seen.append(proposal.finished_host)
            if fail_at is not None and canvas.step + 1 == fail_at:
                raise RuntimeError("stop")
            return super().select(canvas, plan, proposal, st)

    class Frees(Sink):
        def __init__(self):
            self.active = []

        def on_delta(self, delta, canvas):
            mirror = live_mirror(canvas)
            assert mirror is not None and mirror.finished == tuple(canvas.finished.tolist())
            self.active.append(delta.active.tolist())
            if delta.step == free_after:                   # as dlm_engine/serve/engine.py frees a cancelled row
                canvas.finished[1] = True
                mirror.add([False, True, False])

    canvas = Canvas.from_prompts(PROMPTS, GEN, int(model.config.mask_token_id), 0)
    sink = Frees()
    if made is not None:
        made.append(canvas)
    torch.manual_seed(0)
    decode(model, canvas, Recorded(cls.Config(steps=16, block_length=8), GEN), sinks=[sink])
    return canvas, seen, sink.active


def test_select_gets_the_loops_finished_rows_and_a_freed_row_sits_out(tiny_llada):
    plain, seen0, active0 = run(tiny_llada)
    assert seen0[0] == (False,) * 3 and all(len(f) == 3 for f in seen0)
    canvas, seen, active = run(tiny_llada, free_after=2)
    assert seen[:2] == seen0[:2] and all(f[1] for f in seen[2:])     # select knows from the next step on
    assert all(not a[1] for a in active[3:]) and active[2][1]          # and the loop leaves it out from the one after
    for r in (0, 2):                                                   # the other rows decode as before
        assert torch.equal(canvas.tokens[r], plain.tokens[r]) and torch.equal(canvas.step_of[r], plain.step_of[r])
    assert bool(canvas.finished.all())


def test_the_canvas_keeps_no_host_state(tiny_llada):
    canvas, _, _ = run(tiny_llada)
    assert live_mirror(canvas) is None                     # detached after the decode ...
    assert not hasattr(canvas, "finished_host") and canvas.finished.tolist() == [True] * 3   # ... the device's rows
    assert not any(isinstance(v, (dict, tuple)) and v and all(isinstance(x, bool) for x in v)
                   for v in vars(canvas).values())
    assert not any(isinstance(v, dict) for v in vars(canvas).values())    # (no view cache)
    made = []
    with pytest.raises(RuntimeError, match="stop"):
        run(tiny_llada, fail_at=3, made=made)
    assert live_mirror(made[0]) is None                    # detached when a decode fails too
    assert live_mirror(Canvas.from_prompts(PROMPTS, GEN, 99, 0)) is None      # outside a decode: no mirror
