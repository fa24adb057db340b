"""early_exit's host bookkeeping: the masked counts it derives from each step's commits and exit flags (instead of
recounting the canvas) are the canvas' counts after every step, and the answer gap's fewer-op sum is the former
per-column loop bit for bit (signed zeros, NaN and infinities included)."""
import pytest
import torch

from dlm_engine.core.blockwise import block_counts, host_rows
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import strategy_class

PROMPTS = [[735, 559, 771, 678, 375, 377], [127, 157, 983, 804, 991, 537, 902, 490, 136, 103, 962], [413, 750, 0]]
EE = strategy_class("early_exit")


class Checked(EE):
    """Asserts after every host read that the strategy's counts and exit flags are the canvas'."""

    def synced(self, canvas, st, values, delta):
        new = super().synced(canvas, st, values, delta)
        assert new.counts == host_rows(block_counts(canvas, self.block_length).reshape(-1).tolist(),
                                       canvas.batch_size)
        assert new.all_exited == bool(new.exited.all()) and new.any_exited == bool(new.exited.any())
        self.reads += 1
        return new


@pytest.mark.parametrize("kw", [dict(answer_start=0, steps=16, block_length=4),
                                dict(answer_start=0, steps=32, block_length=8, early_threshold=3.0, mid_threshold=1.0),
                                dict(answer_start=2, steps=16, block_length=16, late_threshold=0.0),
                                dict(answer_start=None, steps=16, block_length=8),
                                dict(answer_start=0, steps=16, block_length=8, temperature=0.8, remasking="random",
                                     constraints=[[3, 17], [12, 40]])])
@pytest.mark.parametrize("rows", [1, 3])
def test_counts_from_commits_are_the_canvas_counts(tiny_llada, kw, rows):
    s = Checked(EE.Config(**kw), 32)
    s.reads = 0
    canvas = Canvas.from_prompts(PROMPTS[:rows], 32, 1000, 1001)
    torch.manual_seed(3)
    decode(tiny_llada, canvas, s)
    assert s.reads >= canvas.step > 0


def _former_gap(logits, lo, hi):
    top2 = torch.topk(logits[:, lo:hi], 2, dim=-1).values
    diff = (top2[..., 0] - top2[..., 1]).to(torch.float64)
    total = torch.zeros_like(diff[:, 0])
    for j in range(hi - lo):
        total = total + diff[:, j]
    return total / (hi - lo)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_answer_gap_is_the_former_loop_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 1e-30])
    for trial in range(200):
        B, L, V = 1 + trial % 3, 1 + trial % 7, 2 + trial % 5
        logits = (torch.randn(B, L + 2, V, generator=g) * 10 ** (trial % 4)).to(dtype)
        pick = torch.rand(B, L + 2, V, generator=g) < 0.3
        logits = torch.where(pick, specials[torch.randint(0, len(specials), (B, L + 2, V), generator=g)].to(dtype),
                             logits)
        if trial % 9 == 0:
            logits[..., 0], logits[..., 1:] = -0.0, 0.0        # top-1 -0.0 and top-2 +0.0: a -0.0 difference
        lo = trial % 2
        s = EE(EE.Config(answer_start=lo, answer_length=L), L + 2)
        got, want = s.answer_gap(logits), _former_gap(logits, *s.answer_window)
        # bit for bit, except a NaN's sign bit (IEEE leaves it unspecified for arithmetic results: the CPU cumsum
        # and the loop of adds keep different ones of two NaN operands; both fail every exit test alike)
        got, want = (torch.where(x.isnan(), float("nan"), x) for x in (got, want))
        assert got.dtype == want.dtype and got.numpy().tobytes() == want.numpy().tobytes(), (logits, got, want)
