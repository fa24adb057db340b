"""What the block-diffusion strategies (``fdv2``, ``sdar``) share: blocks aligned at absolute column 0, the
step plans of the forwards that commit nothing or one AR token (prefill, store), the references' top-k / top-p
filters and the error of a decode the reference itself could not finish."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.strategy import CacheDirective, StepPlan, Strategy
from dlm_engine.errors import UserError


class BlockDiffusionError(UserError):
    """A decode the reference itself raises on (e.g. masks left after the last denoising step)."""


class BlockDiffusionStrategy(Strategy):
    """Base: a decode of batch 1 (the references' generate functions take one prompt; ``decode_batch`` splits a
    batch) whose blocks start at multiples of the block length, the first one holding the prompt's tail."""

    max_batch = 1
    sets_attention_blocks = True          # every plan names its mask's block size (CacheDirective.attention_block)
    offers = caps(Cap.BLOCKS, Cap.BLOCK_HANDOVER, Cap.STORE_FORWARDS)
    needs = caps(Cap.BLOCK_LOGITS)

    def max_steps(self, canvas) -> int:
        return 8 * canvas.length + 64


def quiet_plan(start: int, end: int, window: Tuple[int, int], store: Optional[Tuple[int, int]], attention_block: int,
               key_start: int = 0, position_ids=None, block_start: bool = True) -> StepPlan:
    """A forward over ``[start, end)`` whose logits the strategy reads itself (``sample=False``): the prefill or
    store forward of a block (``store``), with ``window`` the columns whose logits it wants (empty: none)."""
    return StepPlan(window=window, sample=False, position_ids=position_ids,
                    cache=CacheDirective(block=(start, end), block_start=block_start,
                                         store=[store] if store is not None else [], attention_block=attention_block,
                                         key_start=key_start))


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Entries below the k-th largest value of their row become -inf (ties at the boundary are kept)."""
    if not k or k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter on logits: sorted descending, an entry is dropped when the cumulative softmax before it
    already exceeds ``p`` (the first entry is always kept); dropped entries become -inf."""
    if p is None or p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cum > p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    remove = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(remove, float("-inf"))


def top_p_probs(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter on probabilities (Fast-dLLM v2): sorted descending, the entry at rank r >= 1 is dropped when
    the cumulative sum up to rank r - 1 exceeds ``p``; the kept ones are renormalised by their sum."""
    sorted_p, order = torch.sort(probs, descending=True, dim=-1)
    cum = sorted_p.cumsum(dim=-1)
    drop = torch.zeros_like(cum, dtype=torch.bool)
    drop[..., 1:] = cum[..., :-1] > p
    remove = torch.zeros_like(drop).scatter(-1, order, drop)
    kept = probs.masked_fill(remove, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)
