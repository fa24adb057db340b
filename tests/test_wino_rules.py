"""WINO's step rules against their general forms, bit for bit: the wide-in rule (:func:`strategies.wino.wide_in`)
against ``d2c_commit`` with a threshold and a cap, and the narrow-out shortcut against the reference's
``where(too_many, lowest & decoded, low)`` -- on fuzzed scores with exact ties, NaN and infinities."""
import random

import torch

from conftest import fuzz_cases
from dlm_engine.core.selection import d2c_commit, topk_rows
from dlm_engine.strategies.wino import wide_cap, wide_in


def fuzzed(rng: random.Random, B: int, W: int):
    pool = [0.1, 0.5, 0.7, 0.7, 0.9, 0.95, 1.0, 0.0]        # few values: exact ties are common
    vals = [[rng.choice(pool) if rng.random() < 0.5 else rng.random() for _ in range(W)] for _ in range(B)]
    scores = torch.tensor(vals, dtype=torch.float64)
    for _ in range(rng.randrange(3)):
        scores[rng.randrange(B), rng.randrange(W)] = rng.choice([float("nan"), float("inf"), float("-inf")])
    cand = torch.rand((B, W), generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < rng.random()
    for b in range(B):                                       # every row that runs has a candidate
        if not cand[b].any():
            cand[b, rng.randrange(W)] = True
    return scores, cand


@fuzz_cases(300)
def test_wide_in_is_d2c_commit(seed):
    rng = random.Random(seed)
    B, W = rng.choice([1, 1, 2, 3, 4]), rng.choice([1, 3, 8, 16, 33])
    scores, cand = fuzzed(rng, B, W)
    ntt = rng.choice([1, 1, 2, 3, 7])
    counts = [int(n) for n in cand.sum(-1)]
    cap = [wide_cap(n, ntt) for n in counts]
    thr = rng.choice([0.3, 0.7, 0.9, 1.0, 0.5])
    want = d2c_commit(scores, cand, ntt, cap, counts=counts, threshold=thr)
    got, n = wide_in(scores, cand, ntt, cap, counts, thr)
    assert torch.equal(got, want)
    assert n.dtype == want.sum(-1).dtype and torch.equal(n, want.sum(-1))


@fuzz_cases(300)
def test_narrow_out_shortcut(seed):
    rng = random.Random(seed)
    B, W = rng.choice([1, 2, 3]), rng.choice([1, 4, 16, 33])
    conf, masked = fuzzed(rng, B, W)
    thr = rng.choice([0.5, 0.9, 0.99, 1.0])
    k = torch.tensor([rng.randrange(W + 2) for _ in range(B)])
    decoded = ~masked
    low = decoded & (conf < thr)
    too_many = low.sum(-1) > k
    lowest = topk_rows(torch.where(decoded, conf, float("inf")), k, largest=False)
    want = torch.where(too_many[:, None], lowest & decoded, low)
    ranked = torch.where(masked, float("inf"), conf)
    got = topk_rows(ranked, k, largest=False) & (ranked < thr)
    assert torch.equal(got, want)
