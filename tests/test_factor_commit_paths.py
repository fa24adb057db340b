"""factor_commit's one-sort form against the general form it replaced (the first failing rank found from the
sorted scores, then the top ``k`` of a stable sort of the reference's row), with the candidates' number known on
the host or counted on the device, on fuzzed scores with exact ties, NaN, infinities and spans."""
import pytest
import torch

from dlm_engine.core.selection import factor_commit, masked_conf, ranked_row, topk_rows


def _general(conf, cand, factor, span=None):
    """The former factor_commit: k from the sorted scores (rank 1 always passes; a failure at the last
    candidate's rank commits every candidate), then the first k of a stable descending sort of the row."""
    W = conf.shape[1]
    M = cand.sum(-1)
    srt = torch.sort(masked_conf(conf, cand), dim=-1, descending=True).values
    ranks = torch.arange(1, W + 1, dtype=torch.float64)
    thresh = 1.0 - factor / (ranks + 1.0)
    thresh[0] = -1.0
    fails = (srt < thresh.to(conf.dtype)[None]) & (ranks[None] <= M[:, None])
    has = fails.any(-1)
    first = torch.where(has, fails.float().argmax(-1) + 1, 0)
    k = torch.where(has & (first <= M - 1), first - 1, M)
    k = torch.where(M == 1, 1, k)
    row, off = ranked_row(conf, cand, span)
    return topk_rows(row, k)[:, off:off + W] & cand


def _fuzz(g, B, W, dtype):
    levels = torch.tensor([0.0, 0.3, 0.6, 0.75, 0.9, 0.95, 0.99, 1.0], dtype=dtype)
    conf = levels[torch.randint(0, len(levels), (B, W), generator=g)]            # many exact ties
    dense = torch.rand(B, W, generator=g, dtype=torch.float64).to(dtype) ** 0.2
    conf = torch.where(torch.rand(B, W, generator=g) < 0.5, conf, dense)
    odd = torch.rand(B, W, generator=g)
    conf = torch.where(odd < 0.04, float("nan"), conf)
    conf = torch.where((odd >= 0.04) & (odd < 0.07), float("-inf"), conf)
    conf = torch.where((odd >= 0.07) & (odd < 0.09), float("inf"), conf)
    cand = torch.rand(B, W, generator=g) < torch.rand(B, 1, generator=g)
    return conf, cand


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [0.01, 0.5, 1.0, 2.0, 8.0])
def test_factor_commit_equals_the_general_form(dtype, factor):
    g = torch.Generator().manual_seed(int(factor * 100) + len(str(dtype)))
    for trial in range(150):
        B = 1 + trial % 3
        W = 1 + int(torch.randint(0, 12, (1,), generator=g))
        conf, cand = _fuzz(g, B, W, dtype)
        if trial % 5 == 0:
            conf[:] = 0.9                                  # every score tied
        off = int(torch.randint(0, 4, (1,), generator=g))
        for span in (None, (off, W + off + int(torch.randint(0, 4, (1,), generator=g)))):
            want = _general(conf, cand, factor, span)
            counts = cand.sum(-1).tolist()
            assert torch.equal(factor_commit(conf, cand, factor, span), want), (conf, cand, span)
            assert torch.equal(factor_commit(conf, cand, factor, span, counts), want), (conf, cand, span, counts)
            if B > 1 and len(set(counts)) == 1:
                continue
            one = cand[:1]                                 # the host path: a single row
            assert torch.equal(factor_commit(conf[:1], one, factor, span, [int(one.sum())]),
                               _general(conf[:1], one, factor, span))
