"""``klass``: KLASS -- commit the positions whose predictive distribution has stopped moving (docs/specs/d2cache.md §8).

The d2c loop (:mod:`strategies.d2c`) with a different selection. Every step measures, per generated position,
the KL divergence of this step's distribution from the previous step's (float64); a position is *stable*
when its last ``kl_history_length`` divergences are all below ``kl_threshold``. Among the block's stable
masked positions the step commits those passing ``threshold`` (or the factor rule); a row with none falls
back to the top ``num_transfer_tokens``. The history and the previous distributions persist across blocks (a
full block's are never read again: they are dropped when the next block starts). The registered class adds the
fast layer's :class:`~dlm_engine.core.fast.block_scored.FromBlockStart`: it samples from the block's start on where
that gives the same bits.

Reference quirk (reproduced by default): without ``threshold`` and ``factor`` the stable set is never used
(its count clamps to 0), so KLASS equals the fixed-rate d2c loop; ``klass_commit_stable=true`` commits every
stable candidate instead. The reference stores the previous distributions in float64 (its as-shipped code
crashes doing so with float32 models; the fixtures were made with the cast, which is what this does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dlm_engine.core.fast.block_scored import FromBlockStart
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.selection import d2c_commit
from dlm_engine.errors import ConfigError
from dlm_engine.core.strategy import evolve
from dlm_engine.strategies.d2c import BlockState, D2CConfig, D2CRule


@dataclass
class KlassConfig(D2CConfig):
    kl_threshold: float = 0.01            # a position is stable when its recent KL divergences are all below this
    kl_history_length: int = 2            # how many recent steps must be stable
    klass_commit_stable: bool = False     # quirk 5: without threshold/factor the stable set is never committed


@dataclass(frozen=True)
class KlassState(BlockState):
    # per generated position from column ``start`` on (the current block's first: the earlier blocks are full and
    # their history is never read again)
    run: Optional[torch.Tensor] = None            # [B, G - start] int64: how many of its latest divergences in a row
                                                  # are below ``kl_threshold`` (the reference keeps the last H
                                                  # divergences and tests them all: the same as this count reaching H)
    previous_log: Optional[torch.Tensor] = None   # [B, G - start, V] float64: log(last step's distributions + 1e-12)
    start: int = 0
    batch: int = 0                                # rows of the canvas


class KlassRule(D2CRule):
    """The KLASS rule (registered as :class:`Klass`, with its fast layer)."""

    def validate(self) -> None:
        super().validate()
        c = self.cfg
        if c.gamma is not None:
            raise ConfigError("strategy.gamma: KLASS selects by threshold or factor among stable positions, not EB")
        if not float(c.kl_threshold) > 0:
            raise ConfigError(f"strategy.kl_threshold={c.kl_threshold} must be > 0")
        self.check_positive("kl_history_length", c.kl_history_length)

    def init_state(self, canvas) -> KlassState:
        return KlassState(batch=canvas.batch_size, density=super().init_state(canvas).density)

    def first_history(self, st: KlassState, G: int, V: int, device) -> KlassState:
        """The state before the first step: the reference's previous distributions are zeros (their logs are
        ``log(1e-12)``) and its history holds H zero divergences, all below the threshold (H - 1 of them are left
        once the first step's divergence, from zeros and huge, is pushed)."""
        H = int(self.cfg.kl_history_length)
        zeros_log = torch.full((st.batch, G, V), 1e-12, dtype=torch.float64, device=device).log_()
        return evolve(st, run=torch.full((st.batch, G), H - 1, dtype=torch.long, device=device), previous_log=zeros_log)

    def pick(self, scores, cand, block_cand, sampled, st: KlassState, rows, counts):
        """Every step measures each position's divergence from its previous distribution, from the block's first
        column on (the call's rows; the others keep their history). ``sampled.probs`` may cover the last columns
        only, from the block's start on (the fast layer's
        :class:`~dlm_engine.core.fast.block_scored.FromBlockStart`)."""
        c = self.cfg
        G = cand.shape[1]
        a = self.block_cols(st.block)[0]
        off = G - sampled.probs.shape[1]                               # sampled.probs covers columns [off, G)
        p64 = sampled.probs[:, a - off:].to(torch.float64)             # [B_a, G - a, V]
        if st.previous_log is None:
            st = self.first_history(st, G, p64.shape[-1], p64.device)
        prev_log, run = st.previous_log[:, a - st.start:], st.run[:, a - st.start:]     # (earlier blocks dropped)
        if rows is not None:
            prev_log, run = prev_log[rows], run[rows]
        log_p = (p64 + 1e-12).log_()                                   # kept: the next step's log(prev + 1e-12)
        kl = torch.sub(log_p, prev_log).mul_(p64).sum(-1)              # sum p (log p - log prev)
        run = torch.where(kl < c.kl_threshold, run + 1, 0)             # (NaN: not below)
        stable = torch.zeros_like(block_cand)                          # the block's stable candidates
        stable[:, a:] = run >= c.kl_history_length
        stable &= block_cand
        if c.threshold is None and c.factor is None and c.klass_commit_stable:
            chosen = stable
        else:
            chosen = d2c_commit(scores, stable, 0, threshold=c.threshold, factor=c.factor)
        fallback = d2c_commit(scores, block_cand, c.num_transfer_tokens, counts=counts)
        commit = torch.where(chosen.any(-1, keepdim=True), chosen, fallback)
        if rows is not None:                                           # the rows that sat the step out keep theirs
            run = st.run[:, a - st.start:].index_copy(0, rows, run)
            log_p = st.previous_log[:, a - st.start:].index_copy(0, rows, log_p)
        return commit, evolve(st, run=run, previous_log=log_p, start=a)


@register_strategy("klass", KlassConfig)
class Klass(FromBlockStart, KlassRule):
    """KLASS, sampling from its block's first column on where that gives the same bits (the fast layer's
    :class:`~dlm_engine.core.fast.block_scored.FromBlockStart`)."""
