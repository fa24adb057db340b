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
from typing import Optional

import torch

from dlm_engine.core.registry import register_strategy
from dlm_engine.core.selection import topk_commit, transfer_schedule
from dlm_engine.core.strategy import BlockCursor, CacheDirective, StepPlan, Strategy, block_range, candidates
from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.eos import EosOptions, check_eos_options, eos_confidence, eos_stop, eos_suppress


@dataclass
class LowConfidenceConfig(EosOptions):            # + logits_eos_inf, confidence_eos_eot_inf, stop_at_eos
    name: str = "low_confidence"
    steps: Optional[int] = None          # total over all blocks; null = gen_length (one token per step)
    block_length: Optional[int] = None   # null = gen_length (a single block)
    temperature: float = 0.0             # Gumbel-max temperature; 0 = argmax
    remasking: str = "low_confidence"    # low_confidence | random
    confidence: str = "prob"             # prob | margin | entropy (used by low_confidence remasking)
    cfg_scale: float = 0.0               # classifier-free guidance (prompt replaced by masks)
    loop: str = "llada"                  # llada | fastdllm


@register_strategy("low_confidence", LowConfidenceConfig)
class LowConfidence(Strategy):
    caches = ("none", "prefix", "dual")

    def validate(self) -> None:
        c = self.cfg
        self.block_length = self.block_length_or_gen(c.block_length)
        self.num_blocks = self.gen_length // self.block_length
        steps = self.gen_length if c.steps is None else int(c.steps)
        self.steps_per_block = self.check_steps_per_block(steps, self.num_blocks)
        self.check_choice("remasking", c.remasking, ("low_confidence", "random"))
        self.check_choice("confidence", c.confidence, ("prob", "margin", "entropy"))
        self.check_choice("loop", c.loop, ("llada", "fastdllm"))
        self.check_non_negative("temperature", c.temperature)
        self.check_non_negative("cfg_scale", c.cfg_scale)

    def init_state(self, canvas):
        check_eos_options(self.cfg, canvas)
        return BlockCursor()

    def plan(self, canvas, cur: BlockCursor) -> Optional[StepPlan]:
        if cur.block >= self.num_blocks:
            return None
        if self.cfg.stop_at_eos and bool(canvas.finished.all()):
            return None
        s, e = block_range(canvas, cur.block, self.block_length)
        if cur.step == 0:
            cur.schedule = transfer_schedule(canvas.masked()[:, s:e].sum(-1), self.steps_per_block)
        c = self.cfg
        return StepPlan(
            window=(s, e), temperature=c.temperature,
            confidence="random" if c.remasking == "random" else c.confidence,
            softmax_dtype="float64" if c.loop == "fastdllm" else "model", cfg_scale=c.cfg_scale,
            cache=CacheDirective(block=(s, e), block_start=cur.step == 0, step_in_block=cur.step),
            suppress=eos_suppress(c, canvas),
        )

    def select(self, canvas, plan, proposal, cur: BlockCursor):
        s, e = plan.window
        cand = candidates(canvas, proposal, e)
        c = self.cfg
        eos_confidence(c, canvas, plan, proposal)
        i = min(cur.step, self.steps_per_block - 1)
        k = cur.schedule[:, i] if cur.step < self.steps_per_block else torch.ones_like(cur.schedule[:, 0])
        commit = topk_commit(proposal.confidence, cand, k)
        events = [BlockEvent("opened", cur.block, s, e)] if cur.step == 0 else []
        cur.step += 1
        if self.cfg.loop == "llada":
            done = cur.step >= self.steps_per_block
        else:
            done = not bool((cand & ~commit).any())
        if done:
            events.append(BlockEvent("completed", cur.block, s, e))
            cur.block, cur.step = cur.block + 1, 0
        delta = self.delta(canvas, proposal, commit, events=events,
                           scalars={"block": cur.block if not done else cur.block - 1, "committed": commit.sum(-1)})
        return eos_stop(c, canvas, delta), cur
