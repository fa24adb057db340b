"""``ar``: left-to-right decoding of the d2Cache framework (docs/specs/d2cache.md §8).

The d2c loop (:mod:`strategies.d2c`); each step takes the contiguous run of masked positions that starts at
the block's first masked position and commits its first ``count`` positions: with ``threshold``, ``count`` is
the number of leading run positions whose confidence is ``>= threshold`` (at least ``num_transfer_tokens``);
without it the reference commits the whole run (quirk 9: a block then costs one step whatever
``num_transfer_tokens``); ``ar_respect_ntt=true`` commits ``num_transfer_tokens`` positions per step instead.
"""
from __future__ import annotations

from dataclasses import dataclass


from dlm_engine.core.fast.block_scored import BlockScored
from dlm_engine.core.registry import register_strategy
from dlm_engine.errors import ConfigError
from dlm_engine.strategies.d2c import D2CConfig, D2CRule


@dataclass
class ARConfig(D2CConfig):
    ar_respect_ntt: bool = False          # quirk 9: without threshold the whole masked run is committed at once


class ARRule(D2CRule):
    """The ar rule (registered as :class:`AR`, with its fast layer)."""

    def validate(self) -> None:
        super().validate()
        c = self.cfg
        for key in ("factor", "gamma", "sigma", "clip_alpha"):
            if getattr(c, key) is not None:
                raise ConfigError(f"strategy.{key}: ar takes a threshold (and debias), not {key}")

    def pick(self, scores, cand, block_cand, sampled, st, rows, counts):
        c = self.cfg
        after = block_cand.cummax(-1).values                  # at or after the row's first candidate
        # the run from the first candidate: at or after it, and before the first gap (a non-candidate after it)
        run = after > (after > block_cand).cummax(-1).values
        if c.threshold is None and not c.ar_respect_ntt:
            return run, st                                    # the whole run (quirk 9)
        # the run's first ``count`` positions, count = min(max(lead, ntt), |run|) with a threshold (lead: the
        # leading run positions scoring >= threshold), else min(ntt, |run|). Rank r in the run is taken when r <= ntt
        # or r <= lead -- which is the position coming before the first one (from the first candidate on) below
        # threshold: no count is summed
        take = run.cumsum(-1) <= c.num_transfer_tokens
        if c.threshold is not None:
            take |= (after > (scores >= c.threshold)).cumsum(-1) == 0
        return run & take, st


@register_strategy("ar", ARConfig)
class AR(BlockScored, ARRule):
    """ar, sampling only the block's candidates where that gives the same bits (the fast layer's
    :class:`~dlm_engine.core.fast.block_scored.BlockScored`: the run and its scores are the block's candidates)."""

    block_pick = ARRule.pick
