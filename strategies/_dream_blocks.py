"""Fast-dLLM's block loop for Dream (``strategy=dream`` with ``block_length``; ``specs`` in docs/specs/dream.md §7).

Per block one full call commits the block's first position unconditionally, then cached calls either fill
the block by ``threshold`` (``alg=confidence_threshold``) or follow the timestep schedule with
negative-entropy confidence. A mixin of :class:`dlm_engine.strategies.dream.Dream`, which supplies the shared
helpers (``_propose``, ``_k``, ``_pick``, ``_delta``, ``_scatter``).
"""
from __future__ import annotations

import dataclasses
from typing import List, Tuple

import torch

from dlm_engine.core.canvas import BlockEvent


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
        commit &= plan.rows[:, None]
        return self._delta(canvas, lo, commit, x0, cval.float(), events=ev, active=plan.rows), \
            dataclasses.replace(st, block_start=False, i=1)

    @staticmethod
    def _masks_left(canvas, bs: int, be: int, lo: int, commit, remask=None) -> bool:
        """Whether block ``[bs, be)`` still has masks after a delta over columns ``[lo, lo + W)``."""
        left = canvas.masked()[:, bs:be].clone()
        a, b = max(lo, bs), min(lo + commit.shape[1], be)
        if b > a:
            if remask is not None:
                left[:, a - bs:b - bs] |= remask[:, a - lo:b - lo]
            left[:, a - bs:b - bs] &= ~commit[:, a - lo:b - lo]
        return bool(left.any())

    def _after_step(self, canvas, st, bs: int, be: int, lo: int, commit, remask=None):
        """The state after a cached step and its block events (``completed`` when the block has no mask left)."""
        if self._masks_left(canvas, bs, be, lo, commit, remask):
            return dataclasses.replace(st, i=st.i + 1), []
        ev: List[BlockEvent] = [BlockEvent("completed", st.block, bs, be)]
        return dataclasses.replace(st, block=st.block + 1, block_start=True, i=0), ev

    def _block_threshold(self, canvas, plan, proposal, st):
        bs, be = self._block(canvas, st.block)
        lo, hi = plan.window
        mask = canvas.masked()[:, lo:hi] & plan.rows[:, None]     # window masks (later blocks too in "rest")
        cval, x0 = self._propose(proposal.logits[mask])           # draws over every mask of the window
        tokens = self._scatter(x0, mask, canvas.mask_id)
        scores = self._scatter(cval, mask, float("-inf"))
        scores[:, be - lo:] = float("-inf")
        want = canvas.masked()[:, bs:be].sum(-1)
        commit = torch.zeros_like(mask)
        kmax = int(want.max())
        if kmax > 0:
            vals, idx = torch.topk(scores, kmax, dim=-1)
            rank = torch.arange(kmax, device=scores.device)[None, :]
            keep = (rank < want[:, None]) & ((rank == 0) | ~(vals < self.cfg.threshold))
            commit.scatter_(1, idx, keep)
            commit &= mask
        nxt, ev = self._after_step(canvas, st, bs, be, lo, commit)
        done = nxt.block >= self.num_blocks
        return self._delta(canvas, lo, commit, tokens, scores.float(), done=done, events=ev, active=plan.rows), nxt

    def _block_schedule(self, canvas, plan, proposal, st):
        bs, be = self._block(canvas, st.block)
        lo, hi = plan.window
        B = canvas.batch_size
        S = self.steps_per_block
        if st.i == S:                                             # the reference's wasted call
            nxt = dataclasses.replace(st, block=st.block + 1, block_start=True, i=0)
            ev = [BlockEvent("completed", st.block, bs, be)]
            empty = torch.zeros((B, hi - lo), dtype=torch.bool, device=canvas.device)
            return self._delta(canvas, lo, empty, proposal.x0, None, done=nxt.block >= self.num_blocks,
                               events=ev, active=plan.rows), nxt
        mask = canvas.masked()[:, lo:hi] & plan.rows[:, None]
        mask[:, be - lo:] = False                                 # only the block's masks
        cval, x0 = self._propose(proposal.logits[mask], "entropy")
        tokens = self._scatter(x0, mask, canvas.mask_id)
        n = mask.sum() / B
        k = self._k(n.float(), st.i, S - 1)
        # confidences over the reference's window [bs, hi): column bs (committed) is -inf
        scores = torch.full((B, hi - bs), float("-inf"), dtype=cval.dtype, device=cval.device)
        scores[:, lo - bs:] = self._scatter(cval, mask, float("-inf"))
        commit = torch.zeros_like(mask)
        remask = None
        if k > 0:
            idx = self._pick(scores, k)
            chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)[:, lo - bs:]
            commit = chosen & mask
            extra = chosen & ~mask & ~canvas.masked()[:, lo:hi]
            if bool(extra.any()):
                remask = extra                                    # batch-average quirk (rows with fewer masks)
        nxt, ev = self._after_step(canvas, st, bs, be, lo, commit, remask)
        conf = scores[:, lo - bs:].float()
        return self._delta(canvas, lo, commit, tokens, conf, remask=remask, done=nxt.block >= self.num_blocks,
                           events=ev, active=plan.rows), nxt
