"""Conditional log-likelihood of a continuation under a masked-diffusion LM (for lm-eval's ``loglikelihood``).

A diffusion LM has no left-to-right factorisation, so ``log p(y | c)`` is estimated by the ELBO that LLaDA
trains with, in its low-variance form (LLaDA paper, conditional likelihood evaluation): for a continuation
``y`` of ``L`` tokens, draw ``l`` uniformly from ``1..L``, mask ``l`` positions of ``y`` chosen uniformly
without replacement, and score

    (L / l) * sum over the masked positions i of log p(y_i | c, y with those positions masked).

The mean over Monte-Carlo samples is an unbiased estimate of the bound (a lower bound of ``log p(y | c)``);
with ``L = 1`` it is exact. Each request's samples run as batched forwards of ``batch_size`` rows; only the
continuation's logits are computed.

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


def greedy_matches(lm, contexts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                   batch_size: int = 8) -> List[bool]:
    """For each pair: does one-token-per-step greedy decoding of ``len(target)`` masks after the context
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
        cfg = greedy.Config(steps=L, block_length=L, temperature=0.0, remasking="low_confidence")
        stats = run_prompts(lm, [list(contexts[i]) for i in idx], lambda cfg=cfg, L=L: greedy(cfg, L),
                            lambda: none(none.Config()), gen_length=L, batch_size=batch_size, warmup=False)
        for i, row in zip(idx, stats.rows):
            out[i] = list(row.tokens) == list(targets[i])
    return out
