"""Fast-dLLM's block loop for Dream (``strategy=dream`` with ``block_length``; ``specs`` in docs/specs/dream.md §7).

Per block one full call commits the block's first position unconditionally, then cached calls either fill
the block by ``threshold`` (``alg=confidence_threshold``) or follow the timestep schedule with
negative-entropy confidence. A mixin of :class:`dlm_engine.strategies.dream.Dream`, which supplies the shared
helpers (``_propose``, ``_k``, ``_pick``, ``_delta``, ``_scatter``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np
import torch

from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.selection import masked_order
from dlm_engine.core.strategy import evolve, masked_after


@dataclass(frozen=True)
class DreamPlan:
    """Per row (host): whether it takes part in the step (its block is not full yet)."""

    rows: Sequence[bool]


class DreamBlockLoop:
    def _block(self, canvas, b: int) -> Tuple[int, int]:
        bs = canvas.gen_start + b * self.block_length
        return bs, bs + self.block_length

    def _block_start(self, canvas, plan, proposal, st):
        bs, be = self._block(canvas, st.block)
        lo, hi = plan.window
        B, W, V = proposal.logits.shape
        cval, x0 = self._propose(proposal.logits.reshape(B * W, V))
        x0, cval = x0.view(B, W), cval.view(B, W)
        commit = torch.zeros((B, W), dtype=torch.bool, device=x0.device)
        commit[:, bs - lo] = x0[:, bs - lo] != canvas.mask_id    # unconditionally (a mask id stays masked)
        ev = [BlockEvent("opened", st.block, bs, be)]
        rows = proposal.active                                    # the rows whose block has masks
        commit &= rows[:, None]
        return self._delta(canvas, lo, commit, x0, cval.float(), events=ev, active=rows), \
            evolve(st, block_start=False, i=1)

    def _window_masks(self, canvas, plan, proposal, st, block_only: bool):
        """The window's masks of the rows that take part (only the block's with ``block_only``), their flat
        order and their number (known on the host)."""
        bs, be = self._block(canvas, st.block)
        lo, hi = plan.window
        mask = canvas.masked_cols(lo, hi) & proposal.active[:, None]
        if block_only:
            mask[:, be - lo:] = False
        per_row = st.inner if block_only or hi == be else st.win
        M = sum(n for n, r in zip(per_row, plan.data.rows) if r)
        return mask, masked_order(mask, M), M

    def _block_threshold(self, canvas, plan, proposal, st):
        bs, be = self._block(canvas, st.block)
        lo, hi = plan.window
        B = canvas.batch_size
        mask, order, _ = self._window_masks(canvas, plan, proposal, st, block_only=False)
        # draws over every mask of the window (later blocks too in "rest")
        cval, x0 = self._propose(proposal.logits.reshape(B * (hi - lo), -1).index_select(0, order))
        tokens = self._scatter(x0, mask, canvas.mask_id, order)
        scores = self._scatter(cval, mask, float("-inf"), order)
        scores[:, be - lo:] = float("-inf")
        want = canvas.masked_cols(bs, be).sum(-1)
        commit = torch.zeros_like(mask)
        kmax = max(row[st.block] for row in st.blocks)            # max(want), read on the host
        if kmax > 0:
            vals, idx = torch.topk(scores, kmax, dim=-1)
            rank = torch.arange(kmax, device=scores.device)[None, :]
            keep = (rank < want[:, None]) & ((rank == 0) | ~(vals < self.cfg.threshold))
            commit.scatter_(1, idx, keep)
            commit &= mask
        return self._cached_delta(canvas, st, lo, commit, tokens, scores.float(), None, proposal), \
            evolve(st, check=True)

    def _cached_delta(self, canvas, st, lo, commit, tokens, conf, remask, proposal):
        """A cached step's delta. Whether it completed the block is decided on the host (``settle``); every row
        is done once the last block has no mask left in any row (a device flag here)."""
        done = False
        if st.block == self.num_blocks - 1:
            bs, be = self._block(canvas, st.block)
            g = canvas.gen_start
            done = ~masked_after(canvas, lo, commit, remask)[:, bs - g:be - g].any()
        return self._delta(canvas, lo, commit, tokens, conf, remask=remask, done=done, active=proposal.active)

    def _block_schedule(self, canvas, plan, proposal, st):
        bs, be = self._block(canvas, st.block)
        lo, hi = plan.window
        B = canvas.batch_size
        S = self.steps_per_block
        if st.i == S:                                             # the reference's wasted call
            nxt = evolve(st, block=st.block + 1, block_start=True, i=0)
            ev = [BlockEvent("completed", st.block, bs, be)]
            empty = torch.zeros((B, hi - lo), dtype=torch.bool, device=canvas.device)
            return self._delta(canvas, lo, empty, proposal.x0, None, done=nxt.block >= self.num_blocks,
                               events=ev, active=proposal.active), nxt
        mask, order, M = self._window_masks(canvas, plan, proposal, st, block_only=True)
        cval, x0 = self._propose(proposal.logits.reshape(B * (hi - lo), -1).index_select(0, order), "entropy")
        tokens = self._scatter(x0, mask, canvas.mask_id, order)
        n = np.float32(M) / np.float32(B)                          # batch average, float32 (reference)
        k = self._k(n, st.i, S - 1)
        # confidences over the reference's window [bs, hi): column bs (committed) is -inf
        scores = torch.full((B, hi - bs), float("-inf"), dtype=cval.dtype, device=cval.device)
        scores[:, lo - bs:] = self._scatter(cval, mask, float("-inf"), order)
        commit = torch.zeros_like(mask)
        remask = None
        if k > 0:
            idx = self._pick(scores, k)
            chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)[:, lo - bs:]
            commit = chosen & mask
            # batch-average quirk: a row with fewer masks than k gets decoded positions re-masked (never a row
            # that sits the step out)
            if any(r and n_r < k for n_r, r in zip(st.inner, plan.data.rows)):
                remask = chosen & ~mask & ~canvas.masked_cols(lo, hi) & proposal.active[:, None]
        conf = scores[:, lo - bs:].float()
        return self._cached_delta(canvas, st, lo, commit, tokens, conf, remask, proposal), \
            evolve(st, check=True)
