"""Selection rules shared by strategies: transfer schedules, top-k, threshold and factor commits.

All functions are batched: ``conf`` is ``[B, W]`` with ``-inf`` (or any value) outside ``cand``.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def transfer_schedule(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """Front-loaded schedule ``[B, steps]``: ``n // S`` per step, the remainder's +1s on the first steps."""
    n = mask_count.to(torch.int64)
    base = torch.div(n, steps, rounding_mode="floor")
    rem = n % steps
    idx = torch.arange(steps, device=n.device)
    return base[:, None] + (idx[None, :] < rem[:, None]).to(torch.int64)


def masked_conf(conf: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    return torch.where(cand, conf, torch.full_like(conf, NEG_INF))


def topk_commit(conf: torch.Tensor, cand: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Commit the ``k[b]`` most confident candidates of each row (never a non-candidate)."""
    B, W = conf.shape
    kmax = int(k.max()) if k.numel() else 0
    commit = torch.zeros_like(cand)
    if kmax <= 0:
        return commit
    kmax = min(kmax, W)
    idx = torch.topk(masked_conf(conf, cand), kmax, dim=-1).indices
    take = torch.arange(kmax, device=conf.device)[None, :] < k[:, None]
    commit.scatter_(1, idx, take)
    return commit & cand


def top1(conf: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """The single most confident candidate of every row that has one."""
    commit = torch.zeros_like(cand)
    idx = masked_conf(conf, cand).argmax(dim=-1, keepdim=True)
    commit.scatter_(1, idx, True)
    return commit & cand & cand.any(dim=-1, keepdim=True)


def threshold_commit(conf: torch.Tensor, cand: torch.Tensor, tau) -> torch.Tensor:
    """Fast-dLLM: the top-1 candidate always, plus every candidate with ``conf >= tau`` (ties commit).

    ``tau`` is a float or a per-row tensor ``[B]``.
    """
    if not torch.is_tensor(tau):
        above = conf >= tau
    else:
        above = conf >= tau.to(conf.dtype)[:, None]
    return (above & cand) | top1(conf, cand)


def factor_commit(conf: torch.Tensor, cand: torch.Tensor, factor: float) -> torch.Tensor:
    """Fast-dLLM factor rule: the longest ranking prefix with ``c_(n) >= 1 - f/(n+1)`` for ranks n >= 2.

    Reproduces the reference's off-by-one: when the first failing rank is the last candidate, every
    candidate is committed.
    """
    B, W = conf.shape
    M = cand.sum(dim=-1)                                             # [B]
    sorted_conf = torch.sort(masked_conf(conf, cand), dim=-1, descending=True).values
    ranks = torch.arange(1, W + 1, device=conf.device, dtype=torch.float64)
    thresh = 1.0 - (factor / (ranks + 1.0))
    thresh[0] = -1.0
    # compare in the confidences' dtype, as torch does with the reference's Python-float thresholds
    fails = (sorted_conf < thresh.to(conf.dtype)[None, :]) & (ranks[None, :] <= M[:, None])
    has_fail = fails.any(dim=-1)
    first = torch.where(has_fail, fails.float().argmax(dim=-1) + 1, torch.zeros_like(M))  # 1-based rank
    k = torch.where(has_fail & (first <= M - 1), first - 1, M)
    k = torch.where(M == 1, torch.ones_like(k), k)
    return topk_commit(conf, cand, k)
