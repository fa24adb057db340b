"""``ar``: left-to-right decoding of the d2Cache framework (docs/specs/d2cache.md §8).

The d2c loop (:mod:`strategies.d2c`); each step takes the contiguous run of masked positions that starts at
the block's first masked position and commits its first ``count`` positions: with ``threshold``, ``count`` is
the number of leading run positions whose confidence is ``>= threshold`` (at least ``num_transfer_tokens``);
without it the reference commits the whole run (quirk 9: a block then costs one step whatever
``num_transfer_tokens``); ``ar_respect_ntt=true`` commits ``num_transfer_tokens`` positions per step instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dlm_engine.core.registry import register_strategy
from dlm_engine.errors import ConfigError
from dlm_engine.strategies.d2c import D2C, D2CConfig


@dataclass
class ARConfig(D2CConfig):
    name: str = "ar"
    ar_respect_ntt: bool = False          # quirk 9: without threshold the whole masked run is committed at once


@register_strategy("ar", ARConfig)
class AR(D2C):
    def validate(self) -> None:
        super().validate()
        c = self.cfg
        for key in ("factor", "gamma", "sigma", "clip_alpha"):
            if getattr(c, key) is not None:
                raise ConfigError(f"strategy.{key}: ar takes a threshold (and debias), not {key}")

    picks_from_block_scores = True      # the run and its scores are the block's candidates

    def pick(self, scores, cand, block_cand, sampled, st, rows, counts):
        c = self.cfg
        G = block_cand.shape[1]
        col = torch.arange(G, device=block_cand.device)
        first = torch.where(block_cand.any(-1), block_cand.int().argmax(-1), torch.full_like(block_cand[:, 0], G, dtype=torch.long))
        after = col[None, :] >= first[:, None]
        run = torch.cumprod((block_cand | ~after).int(), dim=-1).bool() & after      # the run from the first candidate
        n = run.sum(-1)
        if c.threshold is not None:
            good = torch.cumprod(((scores >= c.threshold) | ~after).int(), dim=-1).bool() & run
            lead = good.sum(-1)
            count = torch.minimum(torch.clamp(lead, min=c.num_transfer_tokens), n)
        elif c.ar_respect_ntt:
            count = torch.clamp(n, max=c.num_transfer_tokens)
        else:
            count = n
        rank = torch.cumsum(run.int(), dim=-1)
        return run & (rank <= count[:, None]), st
