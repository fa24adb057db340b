"""``llada2``'s ``eos_early_stop``, on :class:`fakes.ScriptedModel`: the facts the stop decides on (the step committed
an EOS, the first EOS, the masks before it) are recounted on the canvas after the step (``reads``/``settle``), and
the finished row ``select`` tells on the device agrees with that host decision: the decode stops right after the
step that commits an EOS with no mask before it, and goes on to the block's end when a mask precedes it."""
import pytest
import torch

from dlm_engine.app.sinks import RecordingSink
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import load_plugins, strategy_class

from fakes import ScriptedModel, preferring

load_plugins()

V = 64
MASK, EOS = V - 1, V - 2
PROMPT = [5, 6, 7]                  # block 0 holds columns 0..7: generated columns 0..4 are canvas columns 3..7
GEN = 13                            # two blocks of 8


def decoded(conf, eos_early_stop=True, eos_search="window", prompt=PROMPT):
    """Generated column 2 prefers the EOS, the others tokens 10, 11, ...; ``conf``: their probabilities."""
    top = [10 + j for j in range(GEN)]
    top[2] = EOS
    cls = strategy_class("llada2")
    strategy = cls(cls.Config(block_length=8, steps=8, threshold=0.95, eos_early_stop=eos_early_stop,
                              eos_search=eos_search), GEN)
    canvas = Canvas.from_prompts([prompt], GEN, MASK, 0, eos_id=EOS)
    model = ScriptedModel(preferring(top, conf)(canvas.gen_start), V, mask_id=MASK, eos_id=EOS)
    rec = RecordingSink()
    with torch.inference_mode():
        decode(model, canvas, strategy, sinks=[rec])
    return canvas, [d for d in rec.deltas if d.nfe]


def test_a_step_committing_an_eos_with_no_mask_before_it_ends_the_decode():
    canvas, steps = decoded([0.99, 0.99, 0.99] + [0.5] * (GEN - 3))
    assert len(steps) == 1 and canvas.nfe == 1                  # the three confident columns, the EOS among them
    assert steps[0].scalars["stop"] == "eos_early_stop"
    assert steps[0].finished.tolist() == [True] and canvas.finished.tolist() == [True]
    assert canvas.tokens[0, 3:6].tolist() == [10, 11, EOS] and canvas.masked()[0, 6:].all()   # block 0 not full


def test_a_mask_before_the_eos_defers_the_stop_to_the_blocks_end():
    # the EOS (generated column 2) is committed with column 0 while column 1 is still masked: no early stop; the
    # next steps commit one column each (none an EOS) until the block is full, and the decode stops after it
    canvas, steps = decoded([0.99, 0.6, 0.99] + [0.5] * (GEN - 3))
    assert len(steps) == 4 and not any("stop" in d.scalars for d in steps)
    assert [d.finished.tolist() for d in steps] == [[False], [False], [False], [True]]
    assert canvas.tokens[0, 3:8].tolist() == [10, 11, EOS, 13, 14] and canvas.masked()[0, 8:].all()


def test_without_the_option_the_decode_stops_after_the_block():
    canvas, steps = decoded([0.99, 0.99, 0.99] + [0.5] * (GEN - 3), eos_early_stop=False)
    assert len(steps) == 3 and not any("stop" in d.scalars for d in steps)
    assert [d.finished.tolist() for d in steps] == [[False], [False], [True]] and canvas.masked()[0, 8:].all()


@pytest.mark.parametrize("search, stop", [("window", "eos_prompt"), ("generation", "eos_early_stop")])
def test_an_eos_in_the_prompt_counts_for_the_window_search_only(search, stop):
    # the prompt holds an EOS before the generation: the reference's window search finds it first (an empty answer)
    canvas, steps = decoded([0.99, 0.99, 0.99] + [0.5] * (GEN - 3), eos_search=search, prompt=[5, EOS, 7])
    assert len(steps) == 1 and steps[0].scalars["stop"] == stop and canvas.finished.tolist() == [True]
