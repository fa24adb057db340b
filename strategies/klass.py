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
from typing import Optional

import torch

from dlm_engine.core.registry import register_strategy
from dlm_engine.core.selection import d2c_commit
from dlm_engine.errors import ConfigError
from dlm_engine.core.strategy import evolve
from dlm_engine.strategies.d2c import D2C, BlockState, D2CConfig


@dataclass
class KlassConfig(D2CConfig):
    name: str = "klass"
    kl_threshold: float = 0.01            # a position is stable when its recent KL divergences are all below this
    kl_history_length: int = 2            # how many recent steps must be stable
    klass_commit_stable: bool = False     # quirk 5: without threshold/factor the stable set is never committed


@dataclass(frozen=True)
class KlassState(BlockState):
    history: Optional[torch.Tensor] = None    # [B, G, H] float64: the last H divergences per position
    previous_log: Optional[torch.Tensor] = None   # [B, G - from, V] float64: log(last step's distributions + 1e-12)
    previous_from: int = 0                        # the first generated column ``previous_log`` covers


@register_strategy("klass", KlassConfig)
class Klass(D2C):
    def validate(self) -> None:
        super().validate()
        c = self.cfg
        if c.gamma is not None:
            raise ConfigError("strategy.gamma: KLASS selects by threshold or factor among stable positions, not EB")
        if not float(c.kl_threshold) > 0:
            raise ConfigError(f"strategy.kl_threshold={c.kl_threshold} must be > 0")
        self.check_positive("kl_history_length", c.kl_history_length)

    def init_state(self, canvas) -> KlassState:
        super().init_state(canvas)
        # the reference's zeros: nothing is stable at the first step (its divergence from zeros is huge)
        hist = torch.zeros((canvas.batch_size, canvas.gen_length, self.cfg.kl_history_length), dtype=torch.float64,
                           device=canvas.device)
        return KlassState(history=hist)

    picks_from_block_scores = False     # the divergences read every position's distribution from the block on

    def pick(self, scores, cand, block_cand, sampled, st: KlassState, rows, counts):
        """Divergences only from the block's first column on: columns of earlier blocks are decoded (or past
        the row's EOS) and never candidates again, so their history is never read."""
        c = self.cfg
        a = st.block * self.block_len
        p = sampled.probs[:, a:]                                       # [B_a, G - a, V], model dtype
        V = p.shape[-1]
        hist = st.history
        every = rows is None                                           # the call ran every row
        mine = slice(None) if every else rows
        p64 = p.to(torch.float64)
        # kept for the next step: the same values as its log(prev + 1e-12). In place on fresh [B_a, G - a, V]
        # temporaries (the same kernels and values, fewer allocations of the step's largest tensors)
        log_p = (p64 + 1e-12).log_()
        if st.previous_log is None:          # the reference's zeros before the first step
            prev_all = torch.full((), 1e-12, dtype=torch.float64, device=p.device).log().expand(
                hist.shape[0], p.shape[1], V)
        else:
            prev_all = st.previous_log[:, a - st.previous_from:]
        kl = torch.sub(log_p, prev_all[mine]).mul_(p64).sum(-1)       # [B_a, G - a]: sum p (log p - log prev)
        h = torch.roll(hist[mine, a:], -1, dims=-1)
        h[:, :, -1] = kl
        stable = (h < c.kl_threshold).all(-1)
        if a == 0:
            pool = block_cand & stable
        else:
            pool = block_cand.clone()                # (columns before ``a`` are outside the block: never in it)
            pool[:, a:].logical_and_(stable)
        if c.threshold is None and c.factor is None and c.klass_commit_stable:
            chosen = pool
        else:
            chosen = d2c_commit(scores, pool, 0, threshold=c.threshold, factor=c.factor)
        fallback = d2c_commit(scores, block_cand, c.num_transfer_tokens, counts=counts)
        commit = torch.where(chosen.any(-1, keepdim=True), chosen, fallback)
        if not every:
            new_hist = hist.clone()
            new_hist[mine, a:] = h
        elif a == 0:
            new_hist = h                             # a fresh [B, G, H] (roll's result)
        else:
            new_hist = torch.cat([hist[:, :a], h], dim=1)
        prev_log = log_p if every else prev_all.index_copy(0, rows, log_p)
        return commit, evolve(st, history=new_hist, previous_log=prev_log, previous_from=a)
