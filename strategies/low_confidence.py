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
from typing import Optional

import torch

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.eos import EosOptions, check_eos_options, eos_confidence, eos_stop, eos_suppress
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.selection import topk_commit, transfer_schedule
from dlm_engine.core.strategy import (BlockCursor, CacheDirective, Remasking, StepPlan, Strategy, block_range,
                                      candidates)


class Confidence(str, Enum):
    prob = "prob"
    margin = "margin"
    entropy = "entropy"


class Loop(str, Enum):
    llada = "llada"
    fastdllm = "fastdllm"


@dataclass
class LowConfidenceConfig(EosOptions):            # + logits_eos_inf, confidence_eos_eot_inf, stop_at_eos
    name: str = "low_confidence"
    steps: Optional[int] = None          # total over all blocks; null = gen_length (one token per step)
    block_length: Optional[int] = None   # null = gen_length (a single block)
    temperature: float = 0.0             # Gumbel-max temperature; 0 = argmax
    remasking: Remasking = Remasking.low_confidence   # low_confidence | random
    confidence: Confidence = Confidence.prob          # prob | margin | entropy (used by low_confidence remasking)
    cfg_scale: float = 0.0               # classifier-free guidance (prompt replaced by masks)
    loop: Loop = Loop.llada              # llada | fastdllm


@dataclass(frozen=True)
class Schedule:
    """The block cursor plus the current block's transfer schedule ``[B, steps_per_block]``."""

    cursor: BlockCursor = BlockCursor()
    counts: Optional[torch.Tensor] = None


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
        if c.loop == Loop.fastdllm:
            self.needs = caps()     # a block ends when it is full: candidates without logits just wait

    def init_state(self, canvas):
        check_eos_options(self.cfg, canvas)
        return Schedule()

    def plan(self, canvas, st: Schedule):
        cur = st.cursor
        if cur.block >= self.num_blocks:
            return None, st
        if self.cfg.stop_at_eos and bool(canvas.finished.all()):
            return None, st
        s, e = block_range(canvas, cur.block, self.block_length)
        if cur.step == 0:
            st = Schedule(cur, transfer_schedule(canvas.masked()[:, s:e].sum(-1), self.steps_per_block))
        c = self.cfg
        return StepPlan(
            window=(s, e), temperature=c.temperature,
            confidence="random" if c.remasking == Remasking.random else c.confidence.value,
            softmax_dtype="float64" if c.loop == Loop.fastdllm else "model", cfg_scale=c.cfg_scale,
            cache=CacheDirective(block=(s, e), block_start=cur.step == 0, step_in_block=cur.step),
            suppress=eos_suppress(c, canvas),
        ), st

    def select(self, canvas, plan, proposal, st: Schedule):
        s, e = plan.window
        cur, c = st.cursor, self.cfg
        cand = candidates(canvas, proposal, e)
        conf = eos_confidence(c, canvas, plan, proposal)
        k = st.counts[:, cur.step] if cur.step < self.steps_per_block else torch.ones_like(st.counts[:, 0])
        commit = topk_commit(conf, cand, k, proposal.row_span)    # ranked in the reference's row
        if c.loop == Loop.llada:
            done = cur.step + 1 >= self.steps_per_block
        else:
            done = not bool((canvas.masked()[:, s:e] & ~commit).any())
        nxt, events = cur.advance((s, e), done)
        delta = self.delta(canvas, proposal, commit, events=events, confidence=conf,
                           scalars={"block": cur.block, "committed": commit.sum(-1)})
        return eos_stop(c, canvas, delta), Schedule(nxt, None if done else st.counts)
