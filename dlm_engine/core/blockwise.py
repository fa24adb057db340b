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
from typing import Optional, Sequence, Tuple

import torch

from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.eos import EosOptions, check_eos_options, eos_confidence, eos_stop, eos_suppress
from dlm_engine.core.confidence import Remasking, ranking
from dlm_engine.core.strategy import (BlockCursor, CacheDirective, StepPlan, Strategy, block_range,
                                      candidates)


@dataclass(frozen=True)
class BlockState:
    """The block cursor and, from the last host read, the masked positions per row and block."""

    cursor: BlockCursor = BlockCursor()
    counts: Tuple[Tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class FillPlan:
    """What a block-filling plan tells its select: the block's masked positions per row (host; None = unknown,
    e.g. a cache left columns out: the rule counts the candidates on the device)."""

    counts: Optional[Sequence[int]] = None


def block_counts(canvas, block_length: int, masked: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, num_blocks]`` masked positions per row and block of the generation (``masked``: a ``[B, G]`` mask
    to count instead of the canvas'); the last block may be shorter."""
    m = canvas.masked_cols(canvas.gen_start) if masked is None else masked
    B, G = m.shape
    nb = -(-G // block_length)
    if nb == 1:                 # one (possibly short) block: one sum, no pad to the block's width first
        return m.sum(-1, keepdim=True)
    if nb * block_length != G:
        m = torch.nn.functional.pad(m, (0, nb * block_length - G))
    return m.view(B, nb, block_length).sum(-1)


def host_rows(values, batch: int) -> Tuple[Tuple[int, ...], ...]:
    """A flat host list of per-row numbers (row-major) as one tuple of ints per row."""
    n = len(values) // batch
    return tuple(tuple(int(v) for v in values[r * n:(r + 1) * n]) for r in range(batch))


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

    def rule(self, conf: torch.Tensor, cand: torch.Tensor, cur: BlockCursor, span=None, counts=None) -> torch.Tensor:
        """Which candidates to commit this step (``[B, W]`` bool, candidates only); ``span`` is the row the
        reference ranks in (``Proposal.row_span``: exact ties break as its ``torch.topk`` does), ``counts`` the
        block's masked positions per row, known on the host (None: unknown)."""
        raise NotImplementedError

    def init_state(self, canvas):
        check_eos_options(self.cfg, canvas)
        return BlockState()

    def plan(self, canvas, st: "BlockState") -> Tuple[Optional[StepPlan], "BlockState"]:
        cur, counts = st.cursor, st.counts
        while cur.block < self.num_blocks:
            # a block full when it starts (constraints, a prompt-side fill) costs nothing
            if any(row[cur.block] for row in counts):
                break
            cur = BlockCursor(cur.block + 1, 0)
        else:
            return None, st
        s, e = block_range(canvas, cur.block, self.block_length)
        c = self.cfg
        # rows whose block is already full sit the step out (no forward, no NFE): each row's trajectory is the
        # one it has alone
        left = [row[cur.block] for row in counts]
        return StepPlan(
            window=(s, e), temperature=c.temperature,
            confidence=ranking(c.remasking), softmax_dtype="float64",
            cache=CacheDirective(block=(s, e), block_start=cur.step == 0, step_in_block=cur.step),
            suppress=eos_suppress(c, canvas), rows=None if all(left) else [n > 0 for n in left],
            masked=left, data=FillPlan(left),
        ), BlockState(cur, counts)

    def select(self, canvas, plan, proposal, st: "BlockState"):
        s, e = plan.window
        cur = st.cursor
        cand = candidates(canvas, proposal, e)
        conf = eos_confidence(self.cfg, canvas, plan, proposal)
        commit = self.rule(conf, cand, cur, proposal.row_span, plan.data.counts)
        n = commit.sum(-1)
        delta = eos_stop(self.cfg, canvas, self.delta(canvas, proposal, commit, confidence=conf))
        delta.block_events = [BlockEvent("opened", cur.block, s, e)] if cur.step == 0 else []
        delta.scalars.update({"block": cur.block, "committed": n})
        delta.scalars.update(self.step_scalars(proposal, cand, commit))
        return delta, BlockState(BlockCursor(cur.block, cur.step + 1), st.counts)

    # -- what the next plan must know: masked positions per row and block --------------------------------------
    def reads(self, canvas, st: "BlockState"):
        return block_counts(canvas, self.block_length)

    def settle(self, canvas, st: "BlockState", values, delta):
        counts = host_rows(values, canvas.batch_size)
        cur = st.cursor
        if delta is not None and cur.block < self.num_blocks and not any(row[cur.block] for row in counts):
            s, e = block_range(canvas, cur.block, self.block_length)   # the step just filled the block
            delta.block_events.append(BlockEvent("completed", cur.block, s, e))
            cur = BlockCursor(cur.block + 1, 0)
        return BlockState(cur, counts)

    def step_scalars(self, proposal, cand: torch.Tensor, commit: torch.Tensor) -> dict:
        """Extra per-step scalars of a subclass (empty by default)."""
        return {}
