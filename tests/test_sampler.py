"""The shared sampler and selection rules, against the spec's formulas."""
import pytest
import torch

from dlm_engine.core.sampler import confidence_of, propose
from dlm_engine.core.selection import factor_commit, threshold_commit, topk_commit, transfer_schedule


def test_temperature_zero_is_argmax_without_rng():
    logits = torch.randn(2, 5, 11)
    state = torch.random.get_rng_state()
    p = propose(logits, 3, temperature=0.0, confidence="prob")
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(p.x0, logits.argmax(-1))
    assert torch.allclose(p.confidence, torch.softmax(logits, -1).max(-1).values)


def test_gumbel_draws_full_call_shape_in_float64_and_slices_the_window():
    torch.manual_seed(0)
    full = torch.randn(1, 9, 13)
    torch.manual_seed(5)
    p = propose(full[:, 4:7], 4, temperature=0.7, confidence="random", call_len=9, call_start=0)
    after = torch.random.get_rng_state()
    # reference: add_gumbel_noise over the whole call, then rand((B, L)) for random remasking
    torch.manual_seed(5)
    l64 = full.to(torch.float64)
    noise = torch.rand_like(l64)
    ref_x0 = (l64.exp() / (-torch.log(noise)) ** 0.7).argmax(-1)[:, 4:7]
    ref_conf = torch.rand((1, 9))[:, 4:7]
    assert torch.equal(p.x0, ref_x0)
    assert torch.equal(p.confidence, ref_conf)
    assert torch.equal(after, torch.random.get_rng_state())


def test_discarded_draw_consumes_one_full_draw():
    logits = torch.randn(1, 4, 7)
    torch.manual_seed(1)
    a = propose(logits, 0, temperature=1.0, confidence="prob", discard_draws=1)
    torch.manual_seed(1)
    torch.rand(1, 4, 7, dtype=torch.float64)
    b = propose(logits, 0, temperature=1.0, confidence="prob")
    assert torch.equal(a.x0, b.x0)


def test_confidence_kinds():
    logits = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    x0 = torch.tensor([[1, 0]])
    p = torch.softmax(logits, -1)
    assert torch.allclose(confidence_of(logits, x0, "prob"), p.gather(-1, x0[..., None])[..., 0])
    assert torch.allclose(confidence_of(logits, x0, "margin"), torch.tensor([[p[0, 0, 0] - p[0, 0, 1], 0.0]]))
    ent = confidence_of(logits, x0, "entropy")
    assert abs(float(ent[0, 1]) - 1 / 3) < 1e-6 and float(ent[0, 0]) > 1 / 3
    f64 = confidence_of(logits, x0, "prob", dtype="float64")
    assert f64.dtype == torch.float64
    topv = confidence_of(logits, torch.tensor([[0, 2]]), "prob", top_v=2)
    assert float(topv[0, 1]) == 0.0  # proposal outside the top-2 gets 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_entropy_confidence_is_finite_when_probabilities_underflow(dtype):
    """The ``entropy`` confidence of a distribution with probabilities that underflow to 0 (a suppressed token; in
    float16 any probability below 2^-24, i.e. most of a large vocabulary) is a number, close to the float64
    value; its floor is 1e-30 wherever the dtype holds that (the bits there are as before)."""
    from dlm_engine.core.sampler import entropy_floor

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4096) * 4
    logits[..., 7] = float("-inf")
    logits[1, 2, 11] = 40.0                     # a nearly certain position
    x0 = logits.argmax(-1)
    got = confidence_of(logits.to(dtype), x0, "entropy")
    ref = confidence_of(logits.double(), x0, "entropy")
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)
    assert torch.allclose(got.double(), ref, rtol=tol, atol=tol)
    assert entropy_floor(dtype) == (2.0 ** -24 if dtype == torch.float16 else 1e-30)


def test_transfer_schedule_front_loaded():
    assert transfer_schedule(torch.tensor([10]), 4).tolist() == [[3, 3, 2, 2]]
    assert transfer_schedule(torch.tensor([3]), 5).tolist() == [[1, 1, 1, 0, 0]]
    assert transfer_schedule(torch.tensor([8, 5]), 2).tolist() == [[4, 4], [3, 2]]


def test_topk_commit_per_row_k_and_candidates_only():
    conf = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.3, 0.2, 0.8, 0.6]])
    cand = torch.tensor([[True, False, True, True], [True, True, True, True]])
    c = topk_commit(conf, cand, torch.tensor([2, 1]))
    assert c.tolist() == [[False, False, True, True], [False, False, True, False]]


def test_threshold_commit_top1_always_and_ties_commit():
    conf = torch.tensor([[0.2, 0.4, 0.3], [0.95, 0.9, 0.1]], dtype=torch.float64)
    cand = torch.ones_like(conf, dtype=torch.bool)
    c = threshold_commit(conf, cand, 0.9)
    assert c.tolist() == [[False, True, False], [True, True, False]]
    none = threshold_commit(conf, torch.zeros_like(cand), 0.9)
    assert not none.any()


def test_factor_commit_rule_and_last_rank_quirk():
    cand = torch.ones(1, 4, dtype=torch.bool)
    # f = 1: thresholds by rank n>=2: 1 - 1/(n+1) -> 0.667, 0.75, 0.8
    conf = torch.tensor([[0.99, 0.7, 0.5, 0.9]], dtype=torch.float64)   # sorted .99 .9 .7 .5: rank3 .7 < .75
    assert factor_commit(conf, cand, 1.0).sum().item() == 2
    conf = torch.tensor([[0.99, 0.95, 0.9, 0.1]], dtype=torch.float64)  # only the last rank fails -> all 4
    assert factor_commit(conf, cand, 1.0).sum().item() == 4
    conf = torch.tensor([[0.99, 0.1, 0.1, 0.1]], dtype=torch.float64)   # rank 2 fails -> 1
    assert factor_commit(conf, cand, 1.0).sum().item() == 1
    one = torch.tensor([[False, True, False, False]])
    assert factor_commit(conf, one, 1.0).tolist() == [[False, True, False, False]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softmax_dtype", ["float64", "model"])
def test_the_argmax_confidence_is_the_gathered_one_bit_for_bit(dtype, softmax_dtype):
    """At T = 0 the proposal is the logits' argmax, whose probability is read as the softmax's maximum: the same
    bits as gathering it, also with ties, tiny and huge gaps, -inf, +inf and NaN logits."""
    from dlm_engine.core.sampler import confidence_of

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, 96, generator=g) * torch.tensor([0.01, 1.0, 8.0, 30.0, 1e-30, 200.0])[:, None, None]
    x[0, 0, :] = 0.0                                  # every logit tied
    x[1, 1, 5], x[1, 1, 9] = 3.0, 3.0                 # a tie at the maximum
    x[1, 2, :] = float("-inf")                        # a row of -inf
    x[1, 3, 7] = float("inf")
    x[1, 4, 11] = float("nan")
    x[1, 5, :50] = float("-inf")
    x[4, 6, 3] = 1e-38                                # a subnormal gap to the rest
    x = x.to(dtype)
    x0 = x.argmax(-1)
    want = confidence_of(x, x0, "prob", softmax_dtype)
    got = confidence_of(x, x0, "prob", softmax_dtype, x0_is_argmax=True)
    assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
