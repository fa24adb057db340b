"""The d2c family's shortcut selection forms against their general forms, on fuzzed scores with ties, NaN and
infinities: ``d2c_commit`` with the counts on the host (threshold with a cap, EB's and the factor rule's clamps)
against the device-count path and the earlier general host form, and AR's run rule against the count form."""
import random

import torch

from conftest import fuzz_cases
from dlm_engine.core.selection import d2c_commit, eb_count, factor_count, masked_conf, topk_rows
from dlm_engine.strategies.ar import AR, ARConfig


def fuzz(rng: random.Random, B: int, W: int, ties: bool = True):
    """Scores (a few repeated values, NaN and infinities when ``ties``) and candidates (some rows empty)."""
    pool = [0.1, 0.5, 0.9, 0.95, 1.0] + ([float("nan"), float("inf"), float("-inf")] if ties else [])
    if ties:
        scores = torch.tensor([[rng.choice(pool) if rng.random() < 0.4 else rng.random() for _ in range(W)]
                               for _ in range(B)])
    else:
        scores = torch.randperm(B * W, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        scores = (scores.float() / (B * W)).reshape(B, W)
    cand = torch.tensor([[rng.random() < p for _ in range(W)] for p in [rng.choice([0.0, 0.3, 0.8, 1.0])
                                                                            for _ in range(B)]])
    return scores, cand


def general_capped_threshold(scores, cand, min_tt, max_tt, counts, threshold):
    """d2c_commit's earlier host form of the threshold rule with a cap (before the shortcut)."""
    c = masked_conf(scores, cand)
    B = c.shape[0]
    M = list(counts)
    mx = [int(max_tt)] * B if isinstance(max_tt, int) else list(max_tt)
    base = [min(x, min_tt) for x in mx]
    picked = cand & (c >= threshold)
    n = picked.sum(-1)
    mx_t = torch.tensor(mx)
    over = n > mx_t
    k_over, k_base = [min(a, b) for a, b in zip(M, mx)], [min(a, b) for a, b in zip(M, base)]
    num = torch.where(over, mx_t, torch.tensor(base))
    top = torch.where(over[:, None], topk_rows(c, k_over), topk_rows(c, k_base))
    picked = picked & ~over[:, None]
    return torch.where((picked.sum(-1) < num)[:, None], top, picked)


@fuzz_cases(200)
def test_capped_threshold_on_the_host_is_the_general_form(seed):
    rng = random.Random(seed)
    B, W = rng.choice([1, 1, 3]), rng.choice([4, 8, 16])
    scores, cand = fuzz(rng, B, W)
    counts = cand.sum(-1).tolist()
    ntt = rng.choice([1, 2, 3])
    cap = rng.choice([rng.randrange(0, 6), [rng.randrange(0, 6) for _ in range(B)], [5] * B])
    thr = rng.choice([0.3, 0.9, 1.0, 0.5])
    got = d2c_commit(scores, cand, ntt, cap, counts=counts, threshold=thr)
    assert torch.equal(got, general_capped_threshold(scores, cand, ntt, cap, counts, thr))
    if W <= 16:     # without ties the device-count path (a stable sort) picks the same
        s2, c2 = fuzz(rng, B, W, ties=False)
        n2 = c2.sum(-1).tolist()
        assert torch.equal(d2c_commit(s2, c2, ntt, cap, counts=n2, threshold=thr),
                           d2c_commit(s2, c2, ntt, cap, threshold=thr))


def general_eb_factor(scores, cand, min_tt, max_tt, counts, gamma=None, probs=None, eb_over_ranks=False,
                      factor=None):
    """d2c_commit's earlier host form of EB's and the factor rule's counts (a clamp_min, then a minimum with
    per-row counts copied to the device)."""
    c = masked_conf(scores, cand)
    B = c.shape[0]
    M = list(counts)
    mx = M if max_tt is None else ([int(max_tt)] * B if isinstance(max_tt, int) else list(max_tt))
    if gamma is not None:
        k = torch.minimum(eb_count(c, probs, gamma, eb_over_ranks).clamp_min(min_tt), torch.tensor(mx))
        return topk_rows(c, k if max_tt is None else torch.minimum(torch.tensor(M), k))
    base = [min(x, min_tt) for x in mx]
    n1 = (factor_count(c, cand, factor) - 1).clamp_min(0)
    picked = topk_rows(c, torch.minimum(n1, torch.tensor(mx)))
    top = topk_rows(c, [min(a, b) for a, b in zip(M, base)])
    return torch.where((picked.sum(-1) < torch.tensor(base))[:, None], top, picked)


@fuzz_cases(200)
def test_eb_and_factor_clamps_on_the_host_are_the_general_form(seed):
    """The host counts clamp EB's and the factor rule's device counts with one clamp when every row has the same
    bound; without ties the device-count path (stable sorts only) picks the same."""
    rng = random.Random(seed)
    B, W, V = rng.choice([1, 1, 3]), rng.choice([4, 8, 16]), 7
    ntt = rng.choice([1, 2, 3])
    cap = rng.choice([None, None, rng.randrange(0, 6), [rng.randrange(0, 6) for _ in range(B)]])
    probs = torch.rand(B, W, V, generator=torch.Generator().manual_seed(seed)).softmax(-1)
    kw = rng.choice([dict(gamma=rng.choice([0.001, 0.5, 5.0]), probs=probs,
                          eb_over_ranks=rng.choice([False, True])),
                     dict(factor=rng.choice([0.5, 1.0, 2.0]))])
    for ties in (True, False):
        scores, cand = fuzz(rng, B, W, ties)
        counts = cand.sum(-1).tolist()
        got = d2c_commit(scores, cand, ntt, cap, counts=counts, **kw)
        assert torch.equal(got, general_eb_factor(scores, cand, ntt, cap, counts, **kw))
        if not ties:
            assert torch.equal(got, d2c_commit(scores, cand, ntt, cap, **kw))


def ar_count_form(scores, block_cand, ntt, threshold, respect_ntt):
    """AR's selection as a count: the run's first min(max(lead, ntt), |run|) positions (lead: its leading
    positions scoring >= threshold), or min(ntt, |run|) without a threshold."""
    after = block_cand.cummax(-1).values
    run = block_cand & ((after > block_cand).cumsum(-1) == 0)
    if threshold is None and not respect_ntt:
        return run
    n = run.sum(-1)
    if threshold is not None:
        fail = after > (scores >= threshold)
        lead = (run & (fail.cumsum(-1) == 0)).sum(-1)
        count = torch.minimum(torch.clamp(lead, min=ntt), n)
    else:
        count = torch.clamp(n, max=ntt)
    return run & (run.cumsum(-1) <= count[:, None])


@fuzz_cases(200)
def test_ar_run_rule_is_the_count_form(seed):
    rng = random.Random(seed)
    B, W = rng.choice([1, 1, 3]), rng.choice([4, 8, 16])
    scores, cand = fuzz(rng, B, W)
    # candidates outside the "block" (a later block, or masked positions past an EOS) may pass the threshold
    block = cand.clone()
    a, b = sorted(rng.sample(range(W + 1), 2))
    block[:, :a] = False
    block[:, b:] = False
    ntt = rng.choice([1, 2, 3])
    thr = rng.choice([None, 0.5, 0.9])
    respect = rng.choice([False, True])
    ar = AR(ARConfig(threshold=thr, num_transfer_tokens=ntt, ar_respect_ntt=respect), 16)
    scores = torch.where(cand, scores, float("-inf"))
    got, _ = ar.pick(scores, cand, block, None, None, None, None)
    assert torch.equal(got, ar_count_form(scores, block, ntt, thr, respect))
