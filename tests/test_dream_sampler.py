"""Sampler pieces used by Dream's rules: top-p / top-k filters, categorical draws, position draws."""
import torch
import torch.distributions as dists

from dlm_engine.core.sampler import (categorical_draw, draw_tokens, filtered_probs, sample_positions, top_k_filter,
                                top_p_filter)

MIN = torch.finfo(torch.float32).min


def test_top_p_keeps_the_token_that_crosses_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = top_p_filter(logits, 0.7)          # 0.5 < 0.7, 0.8 crosses -> keep the first two
    assert torch.equal(out[0, :2], logits[0, :2]) and (out[0, 2:] == MIN).all()
    out = top_p_filter(logits, 0.4)          # the top token alone already crosses: kept
    assert out[0, 0] == logits[0, 0] and (out[0, 1:] == MIN).all()


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    out = top_k_filter(logits, 2)
    assert out[0, :3].tolist() == [3.0, 2.0, 2.0] and out[0, 3] == MIN
    assert torch.equal(top_k_filter(logits, 10), logits)


def test_filters_change_confidence_not_argmax_at_zero_temperature():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    plain = filtered_probs(logits, 0.0)
    nucleus = filtered_probs(logits, 0.0, top_p=0.5, top_k=10)
    assert torch.equal(plain.argmax(-1), nucleus.argmax(-1))
    assert (nucleus.max(-1).values >= plain.max(-1).values).all()


def test_categorical_draw_makes_the_same_draws_as_torch_distributions():
    p = torch.softmax(torch.randn(6, 40, generator=torch.Generator().manual_seed(1)), -1)
    torch.manual_seed(3)
    ref = dists.Categorical(probs=p).sample()
    after_ref = torch.rand(1)
    torch.manual_seed(3)
    ours = categorical_draw(p)
    assert torch.equal(ours, ref) and torch.equal(torch.rand(1), after_ref)


def test_rejected_probabilities_fall_back_to_argmax_without_rng():
    assert categorical_draw(torch.tensor([[0.2, 0.5, float("nan")]])) is None
    bad = torch.tensor([[0.2, 0.9, -0.1]])              # off the simplex: Categorical would raise
    assert categorical_draw(bad) is None
    state = torch.random.get_rng_state()
    conf, x0 = draw_tokens(bad, 1.0)
    assert x0.tolist() == [1] and conf.tolist() == [0.8999999761581421]
    assert torch.equal(torch.random.get_rng_state(), state)
    draw_tokens(torch.tensor([[0.2, 0.7, 0.1]]), 1.0)   # a valid row does draw
    assert not torch.equal(torch.random.get_rng_state(), state)


def test_draw_tokens_confidence_is_the_probability_of_the_drawn_token():
    p = torch.softmax(torch.randn(4, 30, generator=torch.Generator().manual_seed(2)), -1)
    torch.manual_seed(0)
    conf, x0 = draw_tokens(p, 0.7)
    assert torch.equal(conf, p.gather(-1, x0[:, None]).squeeze(-1))
    conf, x0 = draw_tokens(p, 0.0)
    assert torch.equal(x0, p.argmax(-1))


def test_sample_positions_never_draws_minus_inf():
    scores = torch.tensor([[0.1, float("-inf"), 0.3, float("-inf"), 0.2]] * 3)
    torch.manual_seed(0)
    idx = sample_positions(scores, 3, 0.5)
    assert idx.shape == (3, 3)
    assert not ((idx == 1) | (idx == 3)).any()
    assert all(len(set(r)) == 3 for r in idx.tolist())
