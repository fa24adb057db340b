"""``klass``: KLASS -- commit the positions whose predictive distribution has stopped moving (docs/specs/d2cache.md §8).

The d2c loop (:mod:`strategies.d2c`) with a different selection. Every step measures, per generated position,
the KL divergence of this step's distribution from the previous step's (float64); a position is *stable*
when its last ``kl_history_length`` divergences are all below ``kl_threshold``. Among the block's stable
masked positions the step commits those passing ``threshold`` (or the factor rule); a row with none falls
back to the top ``num_transfer_tokens``. The history and the previous distributions persist across blocks.

Reference quirk (reproduced by default): without ``threshold`` and ``factor`` the stable set is never used
(its count clamps to 0), so KLASS equals the fixed-rate d2c loop; ``klass_commit_stable=true`` commits every
stable candidate instead. The reference stores the previous distributions in float64 (its as-shipped code
crashes doing so with float32 models; the fixtures were made with the cast, which is what this does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

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
    # the current block's columns only (``of_block``): divergences are read for candidates, which lie in the block
    # [B, Lb] int64: per position, how many of its latest divergences in a row are below ``kl_threshold`` (the
    # reference keeps the last H divergences and tests them all: the same as this count reaching H)
    run: Optional[torch.Tensor] = None
    previous_log: Optional[torch.Tensor] = None   # [B, Lb, V] float64: log(last step's distributions + 1e-12)
    of_block: int = -1                            # the block ``run`` and ``previous_log`` describe
    # the later blocks' distributions of each row's last H steps, oldest first ([B, G - ring_from, V], model
    # dtype; None: zeros, the reference's state before a row's first step): a block's divergence history is
    # computed from them when it becomes current, not every step for every later position
    ring: Tuple[Optional[torch.Tensor], ...] = ()
    ring_from: int = 0                            # the first generated column the ring covers
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
        base = super().init_state(canvas)
        return KlassState(ring=(None,) * int(self.cfg.kl_history_length), batch=canvas.batch_size,
                          density=base.density)

    def pick(self, scores, cand, block_cand, sampled, st: KlassState, rows, counts):
        """The reference computes every generated position's divergence every step. Only the block's candidates
        are ever read, and a position is read only once its block is current, when its history holds the
        divergences of the row's last H steps -- which the last H distributions give. So each step computes the
        block's divergences and keeps the later columns' distributions; a new block's history is computed from
        them (the same values: the same float64 operations on the same inputs, per position). ``sampled.probs``
        may cover the last columns only, from the block's start on (the fast layer's
        :class:`~dlm_engine.core.fast.block_scored.FromBlockStart`)."""
        c = self.cfg
        a, b = self.block_cols(st.block)
        off = cand.shape[1] - sampled.probs.shape[1]                   # sampled.probs covers columns [off, G)
        if st.of_block != st.block:
            st = self.enter_block(st, a, b, sampled.probs)
        p64 = sampled.probs[:, a - off:b - off].to(torch.float64)      # [B_a, Lb, V]
        # kept for the next step: the same values as its log(prev + 1e-12). In place on a fresh temporary
        log_p = (p64 + 1e-12).log_()
        prev_log, run = (st.previous_log, st.run) if rows is None else (st.previous_log[rows], st.run[rows])
        kl = torch.sub(log_p, prev_log).mul_(p64).sum(-1)               # [B_a, Lb]: sum p (log p - log prev)
        run = torch.where(kl < c.kl_threshold, run + 1, 0)              # (NaN: not below)
        stable = torch.zeros_like(block_cand)                           # the block's stable candidates
        stable[:, a:b] = block_cand[:, a:b] & (run >= c.kl_history_length)
        if c.threshold is None and c.factor is None and c.klass_commit_stable:
            chosen = stable
        else:
            chosen = d2c_commit(scores, stable, 0, threshold=c.threshold, factor=c.factor)
        fallback = d2c_commit(scores, block_cand, c.num_transfer_tokens, counts=counts)
        commit = torch.where(chosen.any(-1, keepdim=True), chosen, fallback)
        if rows is not None:
            run, log_p = st.run.index_copy(0, rows, run), st.previous_log.index_copy(0, rows, log_p)
        return commit, evolve(st, run=run, previous_log=log_p, ring=self.pushed(st, sampled.probs, b, rows, off),
                              ring_from=b)

    def enter_block(self, st: KlassState, a: int, b: int, like: torch.Tensor) -> KlassState:
        """The state describing block ``[a, b)`` (``like``: this step's distributions, for the batch size, dtype
        and vocabulary): its columns' run of divergences below the threshold and last logs, from the ring."""
        H = len(st.ring)
        zeros = None
        ring = []
        for r in st.ring:
            if r is None:
                if zeros is None:
                    zeros = like.new_zeros((st.batch, b - a, like.shape[-1]))
                r = zeros
            else:
                r = r[:, a - st.ring_from:b - st.ring_from]
            ring.append(r)
        if all(r is None for r in st.ring):     # no step yet: the zeros' logs, and a history of zeros (all below)
            run = torch.full((st.batch, b - a), H - 1, dtype=torch.long, device=like.device)
            return evolve(st, run=run, previous_log=(zeros.to(torch.float64) + 1e-12).log_(), of_block=st.block)
        logs = [(r.to(torch.float64) + 1e-12).log_() for r in ring]
        # the history's slots 1..H-1 (slot 0 is rolled out at this step): the divergence of the ring's entry j from
        # entry j - 1; a pair of zero entries (steps before the row's first) gives 0, the reference's initial
        # history, and its first step's divergence from zeros is huge as there. The run counts them oldest first
        run = torch.zeros((st.batch, b - a), dtype=torch.long, device=like.device)
        for j in range(1, H):
            kl = torch.sub(logs[j], logs[j - 1]).mul_(ring[j].to(torch.float64)).sum(-1)
            run = torch.where(kl < self.cfg.kl_threshold, run + 1, 0)
        return evolve(st, run=run, previous_log=logs[-1], of_block=st.block)

    def pushed(self, st: KlassState, probs: torch.Tensor, b: int, rows, off: int = 0) -> Tuple[Optional[torch.Tensor], ...]:
        """The ring once the call's rows (``rows``; None: every row) took this step's distributions ``probs``
        (``[B_a, G - off, V]``: columns from ``off`` on): columns from ``b`` (the block's end) on, each row's last
        H steps."""
        H, G = len(st.ring), off + probs.shape[1]
        if b >= G:                      # the last block: no later column is ever read
            return (None,) * H
        old = [None if r is None else r[:, b - st.ring_from:] for r in st.ring]
        new = probs[:, b - off:]
        if rows is None:
            return tuple(old[1:]) + (new,)
        out = []
        for k in range(H):              # active rows shift by one entry; the others keep theirs
            keep = old[k]
            take = new if k == H - 1 else (None if old[k + 1] is None else old[k + 1][rows])
            if keep is None and take is None:
                out.append(None)
                continue
            if keep is None:
                keep = new.new_zeros((st.batch,) + tuple(new.shape[1:]))
            out.append(keep.index_fill(0, rows, 0) if take is None else keep.index_copy(0, rows, take))
        return tuple(out)


@register_strategy("klass", KlassConfig)
class Klass(FromBlockStart, KlassRule):
    """KLASS, sampling from its block's first column on where that gives the same bits (the fast layer's
    :class:`~dlm_engine.core.fast.block_scored.FromBlockStart`)."""
