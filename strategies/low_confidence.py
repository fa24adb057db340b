"""``low_confidence``: LLaDA's semi-autoregressive decoding with a fixed transfer schedule.

Each block of ``block_length`` positions gets ``steps / num_blocks`` steps; step ``i`` commits the
``k_i`` most confident masked positions of the block (front-loaded schedule). ``remasking=random``
ranks by uniform noise instead. ``loop`` picks the reference loop control:

* ``llada`` (default): every scheduled step runs, zero-transfer steps included; softmax in model dtype.
* ``fastdllm``: Fast-dLLM's fixed-schedule loop — a block ends as soon as it is full (zero-transfer
  steps are not run) and confidences use a float64 softmax.

EOS policy (LLaDA ``generate``, ids from the model config): ``logits_eos_inf`` never proposes EOS;
``confidence_eos_eot_inf`` ranks EoT (and, at ``T = 0``, EOS) proposals last (reference quirk, see
:mod:`dlm_engine.core.eos`); ``stop_at_eos`` ends a row once an EOS is committed with every position before it
decoded (the rest of the row becomes EOS) and stops decoding when every row has ended.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence, Tuple


from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.eos import EosOptions, check_eos_options, eos_confidence, eos_stop, eos_suppress
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.blockwise import block_counts, host_rows
from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.confidence import Confidence, Remasking, check_kind, ranking
from dlm_engine.core.selection import host_schedule, topk_commit
from dlm_engine.core.strategy import (BlockCursor, CacheDirective, StepPlan, Strategy, block_range,
                                      candidates, evolve)


class Loop(str, Enum):
    llada = "llada"
    fastdllm = "fastdllm"


@dataclass
class LowConfidenceConfig(EosOptions):            # + logits_eos_inf, confidence_eos_eot_inf, stop_at_eos
    steps: Optional[int] = None          # total over all blocks; null = gen_length (one token per step)
    block_length: Optional[int] = None   # null = gen_length (a single block)
    temperature: float = 0.0             # Gumbel-max temperature; 0 = argmax
    remasking: Remasking = Remasking.low_confidence   # low_confidence | random
    confidence: Confidence = Confidence.prob          # prob | margin | entropy (used by low_confidence remasking)
    cfg_scale: float = 0.0               # classifier-free guidance (prompt replaced by masks)
    loop: Loop = Loop.llada              # llada | fastdllm


@dataclass(frozen=True)
class Schedule:
    """The block cursor, the current block's transfer schedule per row (host ints) and, from the last host
    read, the masked positions per row and block and whether every row is finished."""

    cursor: BlockCursor = BlockCursor()
    schedule: Tuple[Tuple[int, ...], ...] = ()
    counts: Tuple[Tuple[int, ...], ...] = ()
    all_finished: bool = False


@dataclass(frozen=True)
class TransferPlan:
    """The step's transfer count per row (its schedule's entry)."""

    k: Sequence[int]


@register_strategy("low_confidence", LowConfidenceConfig)
class LowConfidence(Strategy):
    offers = caps(Cap.BLOCKS)
    needs = caps(Cap.BLOCK_LOGITS)

    def validate(self) -> None:
        c = self.cfg
        self.block_length = self.block_length_or_gen(c.block_length)
        self.num_blocks = self.gen_length // self.block_length
        steps = self.gen_length if c.steps is None else int(c.steps)
        self.steps_per_block = self.check_steps_per_block(steps, self.num_blocks)
        self.check_non_negative("temperature", c.temperature)
        self.check_non_negative("cfg_scale", c.cfg_scale)
        check_kind("confidence", c.confidence, (Confidence.prob, Confidence.margin, Confidence.entropy))
        if c.loop == Loop.fastdllm:
            self.needs = caps()     # a block ends when it is full: candidates without logits just wait

    def init_state(self, canvas):
        check_eos_options(self.cfg, canvas)
        return Schedule()

    def plan(self, canvas, st: Schedule):
        cur, c = st.cursor, self.cfg
        if cur.block >= self.num_blocks or (c.stop_at_eos and st.all_finished):
            return None, st
        s, e = block_range(canvas, cur.block, self.block_length)
        left = [row[cur.block] for row in st.counts]
        if cur.step == 0:
            st = evolve(st, schedule=host_schedule(left, self.steps_per_block))
        rows = None
        if c.loop == Loop.fastdllm and not all(left):   # rows whose block is full sit the step out
            rows = [n > 0 for n in left]
        i = min(cur.step, self.steps_per_block - 1)
        k = [sch[i] if cur.step < self.steps_per_block else 1 for sch in st.schedule]
        return StepPlan(
            window=(s, e), temperature=c.temperature,
            confidence=ranking(c.remasking, c.confidence),
            softmax_dtype="float64" if c.loop == Loop.fastdllm else "model", cfg_scale=c.cfg_scale,
            cache=CacheDirective(block=(s, e), block_start=cur.step == 0, step_in_block=cur.step),
            suppress=eos_suppress(c, canvas), rows=rows, masked=left, data=TransferPlan(k),
        ), st

    def select(self, canvas, plan, proposal, st: Schedule):
        s, e = plan.window
        cur, c = st.cursor, self.cfg
        cand = candidates(canvas, proposal, e)
        conf = eos_confidence(c, canvas, plan, proposal)
        commit = topk_commit(conf, cand, plan.data.k, proposal.row_span)     # ranked in the reference's row
        # LLaDA runs every scheduled step; Fast-dLLM's loop ends the block when it is full (decided in settle)
        done = c.loop == Loop.llada and cur.step + 1 >= self.steps_per_block
        nxt, events = cur.advance((s, e), done)
        delta = self.delta(canvas, proposal, commit, confidence=conf, events=events,
                           scalars={"block": cur.block, "committed": commit.sum(-1)})
        return eos_stop(c, canvas, delta), evolve(st, cursor=nxt)

    # -- what the next plan must know: masked positions per row and block --------------------------------------
    def reads(self, canvas, st: Schedule):
        return block_counts(canvas, self.block_length)

    def settle(self, canvas, st: Schedule, values, delta):
        counts = host_rows(values, canvas.batch_size)
        # every row finished = no masked generated position left in any row (a row finished at an EOS has the rest
        # of its generation filled with EOS)
        st = evolve(st, counts=counts, all_finished=not any(map(any, counts)))
        cur = st.cursor
        if (delta is not None and self.cfg.loop == Loop.fastdllm and cur.block < self.num_blocks
                and not any(row[cur.block] for row in counts)):
            s, e = block_range(canvas, cur.block, self.block_length)
            delta.block_events.append(BlockEvent("completed", cur.block, s, e))
            st = evolve(st, cursor=BlockCursor(cur.block + 1, 0))
        return st
