"""Conditional log-likelihood of a continuation under a masked-diffusion LM (for lm-eval's ``loglikelihood``).

A diffusion LM has no left-to-right factorisation, so ``log p(y | c)`` is estimated by the ELBO that LLaDA
trains with, in its low-variance form (LLaDA paper, conditional likelihood evaluation): for a continuation
``y`` of ``L`` tokens, draw ``l`` uniformly from ``1..L``, mask ``l`` positions of ``y`` chosen uniformly
without replacement, and score

    (L / l) * sum over the masked positions i of log p(y_i | c, y with those positions masked).

The mean over Monte-Carlo samples is an unbiased estimate of the bound (a lower bound of ``log p(y | c)``);
with ``L = 1`` it is exact. Each request's samples run as batched forwards of ``batch_size`` rows; only the
continuation's logits are computed.

On a block-diffusion model (``block_diffusion``: Fast-dLLM v2, SDAR, LLaDA2.x) the objective is per block: blocks
of the model's ``block_size`` aligned to position 0, each block denoised given the clean blocks before it, so
``log p(y | c) = sum_b log p(y_b | c, y_<b)`` and each term gets the bound above over the continuation positions
``y_b`` of block ``b`` (``L_b`` of them, ``l_b ~ U{1..L_b}``) with every earlier position clean. One forward row
per (sample, block) scores all of them at once: under the block-causal mask a block's logits do not depend on the
later blocks, which stay clean. It is exact when every block holds one continuation token.

``greedy_matches`` answers lm-eval's ``is_greedy``: does decoding the masked continuation one token per step
(highest-confidence position, argmax token, LLaDA's low-confidence remasking at temperature 0) give ``y``?
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from dlm_engine.errors import UserError


def _check(samples: int, batch_size: int) -> None:
    if int(samples) < 1:
        raise UserError(f"mc_samples={samples} must be a positive integer")
    if int(batch_size) < 1:
        raise UserError(f"mc_batch_size={batch_size} must be a positive integer")


@torch.inference_mode()
def mc_loglikelihood(lm, context: Sequence[int], target: Sequence[int], samples: int = 128,
                     batch_size: int = 32, generator: Optional[torch.Generator] = None) -> float:
    """Monte-Carlo ELBO estimate of ``log p(target | context)`` (see the module docstring).

    ``lm`` is a :class:`dlm_engine.app.api.LoadedModel`; ``generator`` (a CPU ``torch.Generator``) makes
    the masks reproducible.
    """
    _check(samples, batch_size)
    L, P = len(target), len(context)
    if L == 0:
        return 0.0
    if P == 0:
        raise UserError("loglikelihood: empty context (a diffusion LM scores a continuation given a context)")
    device = lm.device
    seq = torch.tensor(list(context) + list(target), dtype=torch.long, device=device)
    y = seq[P:]
    # all masks are drawn up front, so the estimate does not depend on batch_size: l ~ U{1..L} per sample,
    # and the l positions with the smallest random keys are masked (a uniform l-subset)
    if getattr(lm.model, "block_diffusion", False):
        return _block_loglikelihood(lm, seq, P, L, int(samples), int(batch_size), generator)
    all_lengths = torch.randint(1, L + 1, (int(samples),), generator=generator)
    all_ranks = torch.rand(int(samples), L, generator=generator).argsort(dim=1).argsort(dim=1)
    total = torch.zeros((), dtype=torch.float64, device=device)
    done = 0
    while done < samples:
        n = min(int(batch_size), int(samples) - done)
        lengths = all_lengths[done:done + n]
        masked = (all_ranks[done:done + n] < lengths[:, None]).to(device)
        ids = seq.expand(n, -1).clone()
        ids[:, P:] = y.masked_fill(masked, lm.mask_id)
        logits = lm.model(ids, logits_range=(P, P + L)).logits        # [n, L, V]
        logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, y.expand(n, -1)[..., None])[..., 0]
        per_sample = (logp * masked).sum(dim=1) * (L / lengths.to(device=device, dtype=torch.float64))
        total += per_sample.sum()
        done += n
    return float(total / samples)


def _block_loglikelihood(lm, seq: torch.Tensor, P: int, L: int, samples: int, batch_size: int,
                         generator: Optional[torch.Generator]) -> float:
    """The per-block bound of the module docstring; ``batch_size`` rows (one (sample, block) pair each) a forward."""
    device = lm.device
    size = int(lm.model.block_size)
    cols = torch.arange(P, P + L)
    blk = torch.div(cols, size, rounding_mode="floor")
    blk = blk - blk[0]                                   # block of each continuation position, 0..nb-1
    nb = int(blk[-1]) + 1
    per_block = torch.bincount(blk, minlength=nb)        # L_b
    # every (sample, block): l_b ~ U{1..L_b} and a uniform l_b-subset of the block's positions (drawn up front)
    lengths = (torch.rand(samples, nb, generator=generator) * per_block).floor().long() + 1        # [S, nb]
    keys = torch.rand(samples, L, generator=generator)
    keys = keys + blk.to(keys.dtype) * 2.0               # ranks within each block: sort by (block, key)
    rank = keys.argsort(dim=1).argsort(dim=1) - (torch.cumsum(per_block, 0) - per_block)[blk]
    # rows: (sample s, block b) -> masked where blk == b and rank < l_b
    masked_all = (blk[None, None, :] == torch.arange(nb)[None, :, None]) & (rank[:, None, :] < lengths[:, :, None])
    weight_all = per_block[None, :].double() / lengths.double()                                    # [S, nb]
    masked_all, weight_all = masked_all.reshape(samples * nb, L), weight_all.reshape(-1)
    y = seq[P:]
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, samples * nb, batch_size):
        masked = masked_all[start:start + batch_size].to(device)
        n = masked.shape[0]
        ids = seq.expand(n, -1).clone()
        ids[:, P:] = y.masked_fill(masked, lm.mask_id)
        logits = lm.model(ids, logits_range=(P, P + L)).logits
        logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, y.expand(n, -1)[..., None])[..., 0]
        total += ((logp * masked).sum(dim=1) * weight_all[start:start + n].to(device)).sum()
    return float(total / samples)


def greedy_matches(lm, contexts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                   batch_size: int = 8) -> List[bool]:
    """For each pair: does one-token-per-step greedy decoding of ``len(target)`` masks after the context (on a
    block-diffusion model: whole blocks of its own size, the target being the start of the generation)
    reproduce the target exactly? Pairs with the same target length decode together."""
    from dlm_engine.app.api import run_prompts
    from dlm_engine.core.registry import cache_class, load_plugins, strategy_class

    load_plugins()
    out = [False] * len(contexts)
    by_length = {}
    for i, t in enumerate(targets):
        by_length.setdefault(len(t), []).append(i)
    greedy = strategy_class("low_confidence")
    none = cache_class("none")
    for L, idx in by_length.items():
        if L == 0:
            for i in idx:
                out[i] = True
            continue
        G, B = L, L
        if getattr(lm.model, "block_diffusion", False):
            # a block-causal model decodes blocks of its own size: whole blocks, and the target is their start
            B = int(lm.model.block_size)
            G = -(-L // B) * B
        cfg = greedy.Config(steps=G, block_length=B, temperature=0.0, remasking="low_confidence")
        stats = run_prompts(lm, [list(contexts[i]) for i in idx], lambda cfg=cfg, G=G: greedy(cfg, G),
                            lambda: none(none.Config()), gen_length=G, batch_size=batch_size, warmup=False)
        for i, row in zip(idx, stats.rows):
            out[i] = list(row.tokens)[:L] == list(targets[i])
    return out
