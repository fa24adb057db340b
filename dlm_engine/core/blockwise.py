"""Shared base of the Fast-dLLM-style strategies: decode one block at a time until it is full.

Each step queries the current block, lets a *commit rule* (threshold, factor, ...) pick which
candidates to commit, and moves to the next block as soon as the current one has no mask left
(Fast-dLLM v2 loop control: a full block never costs another forward). Subclasses only provide
:meth:`FillBlocks.rule` and, if they like, extra validation and scalars. Every such strategy has the EOS
options of :class:`dlm_engine.core.eos.EosOptions` (``logits_eos_inf``, ``confidence_eos_eot_inf``,
``stop_at_eos``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.eos import EosOptions, check_eos_options, eos_confidence, eos_stop, eos_suppress
from dlm_engine.core.strategy import (BlockCursor, CacheDirective, Remasking, StepPlan, Strategy, block_range,
                                      candidates)


@dataclass
class FillBlocksConfig(EosOptions):
    """Fields every block-filling strategy has (subclass it and add ``name`` plus the rule's knobs);
    the EOS options come from :class:`EosOptions`."""

    steps: Optional[int] = None          # only checked: divisible by the number of blocks (as the reference)
    block_length: Optional[int] = None   # null = gen_length (a single block)
    temperature: float = 0.0             # Gumbel-max temperature; 0 = argmax
    remasking: Remasking = Remasking.low_confidence   # low_confidence (float64 softmax of p(x0)) | random


class FillBlocks(Strategy):
    """Block-by-block decoding; a block ends when it is full. Subclasses implement :meth:`rule`.

    Candidates whose logits a cache did not compute are never committed, so these strategies work with
    every cache; the block still ends only when all its positions are decoded."""

    offers = caps(Cap.BLOCKS)
    needs = caps()

    def validate(self) -> None:
        c = self.cfg
        self.block_length = self.block_length_or_gen(c.block_length)
        self.num_blocks = self.gen_length // self.block_length
        if c.steps is not None:
            self.check_steps_per_block(int(c.steps), self.num_blocks)
        self.check_non_negative("temperature", c.temperature)

    def rule(self, conf: torch.Tensor, cand: torch.Tensor, cur: BlockCursor, span=None) -> torch.Tensor:
        """Which candidates to commit this step (``[B, W]`` bool, a subset of ``cand``); ``span`` is the row the
        reference ranks in (``Proposal.row_span``: exact ties break as its ``torch.topk`` does)."""
        raise NotImplementedError

    def init_state(self, canvas):
        check_eos_options(self.cfg, canvas)
        return BlockCursor()

    def plan(self, canvas, cur: BlockCursor) -> Tuple[Optional[StepPlan], BlockCursor]:
        while cur.block < self.num_blocks:
            s, e = block_range(canvas, cur.block, self.block_length)
            # the block-full test sits before the forward (v2 loop): a block that is full when it
            # starts (constraints, or a prompt-side fill) costs nothing
            if cur.step > 0 or bool(canvas.masked()[:, s:e].any()):
                break
            cur = BlockCursor(cur.block + 1, 0)
        else:
            return None, cur
        c = self.cfg
        # rows whose block is already full sit the step out (no forward, no NFE): each row's trajectory is the
        # one it has alone
        waiting = canvas.masked()[:, s:e].any(-1)
        return StepPlan(
            window=(s, e), temperature=c.temperature,
            confidence="random" if c.remasking == Remasking.random else "prob", softmax_dtype="float64",
            cache=CacheDirective(block=(s, e), block_start=cur.step == 0, step_in_block=cur.step),
            suppress=eos_suppress(c, canvas), rows=waiting,
        ), cur

    def select(self, canvas, plan, proposal, cur: BlockCursor):
        s, e = plan.window
        cand = candidates(canvas, proposal, e)
        conf = eos_confidence(self.cfg, canvas, plan, proposal)
        commit = self.rule(conf, cand, cur, proposal.row_span) & cand
        active = plan.rows & ~canvas.finished if plan.rows is not None else None
        delta = eos_stop(self.cfg, canvas, self.delta(canvas, proposal, commit, confidence=conf, active=active))
        # rows finished by this step (stop_at_eos fills their remaining masks) leave nothing in the block
        left = canvas.masked()[:, s:e] & ~commit & ~delta.finished[:, None]
        nxt, events = cur.advance((s, e), done=not bool(left.any()))
        delta.block_events = events
        delta.scalars.update({"block": cur.block, "committed": commit.sum(-1)})
        delta.scalars.update(self.step_scalars(proposal, cand, commit))
        return delta, nxt

    def step_scalars(self, proposal, cand: torch.Tensor, commit: torch.Tensor) -> dict:
        """Extra per-step scalars of a subclass (empty by default)."""
        return {}
