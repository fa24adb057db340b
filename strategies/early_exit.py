"""``early_exit``: Prophet — LLaDA decoding that stops as soon as the answer is settled.

Decoding is LLaDA's (fixed front-loaded schedule per block, every scheduled step runs, softmax in
model dtype, optional CFG). Each step, before committing, the mean top-1 minus top-2 gap of the
*raw* logits over an answer window of ``answer_length`` positions is compared with a threshold that
depends on the phase of decoding (``global_step / steps`` < 0.33: early, < 0.67: mid, else late).
If ``gap >= threshold`` the row goes "all-in": every position of its generation that is still masked
(all remaining blocks) takes this step's proposal and the row is finished. ``constraints`` fix tokens
at generation positions before decoding (they count as given: never candidates, masked for CFG).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from dlm_engine.core.canvas import BlockEvent
from dlm_engine.errors import ConfigError
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.selection import topk_commit, transfer_schedule
from dlm_engine.core.strategy import BlockCursor, CacheDirective, StepPlan, Strategy, block_range, candidates

PHASES = ((0.33, "early"), (0.67, "mid"), (float("inf"), "late"))


@dataclass
class EarlyExitConfig:
    name: str = "early_exit"
    steps: Optional[int] = None             # total over all blocks; null = gen_length
    block_length: Optional[int] = None      # null = gen_length (a single block)
    temperature: float = 0.0
    remasking: str = "low_confidence"       # low_confidence | random
    cfg_scale: float = 0.0
    answer_start: Optional[int] = None      # answer window start, offset from the generation start; null = never exit
    answer_length: int = 5                  # answer window size (Prophet hard-codes 5)
    early_threshold: float = 7.5            # logit gap needed to exit while global_step/steps < 0.33
    mid_threshold: float = 5.0              # ... < 0.67
    late_threshold: float = 2.5             # ... afterwards
    constraints: Optional[List[List[int]]] = None  # [[generation position, token id], ...], given tokens


@dataclass
class ExitState:
    cursor: BlockCursor
    exited: torch.Tensor                     # [B] bool: rows that went all-in


@register_strategy("early_exit", EarlyExitConfig)
class EarlyExit(Strategy):
    caches = ("none",)

    def validate(self) -> None:
        c = self.cfg
        self.block_length = self.block_length_or_gen(c.block_length)
        self.num_blocks = self.gen_length // self.block_length
        self.steps = self.gen_length if c.steps is None else int(c.steps)
        self.steps_per_block = self.check_steps_per_block(self.steps, self.num_blocks)
        self.check_choice("remasking", c.remasking, ("low_confidence", "random"))
        self.check_non_negative("temperature", c.temperature)
        self.check_non_negative("cfg_scale", c.cfg_scale)
        self.check_positive("answer_length", c.answer_length)
        self.answer_window = None
        if c.answer_start is not None:
            lo, hi = max(int(c.answer_start), 0), min(int(c.answer_start) + c.answer_length, self.gen_length)
            if lo >= hi:
                raise ConfigError(f"strategy.answer_start={c.answer_start} puts the answer window outside the "
                                  f"generation (gen_length={self.gen_length})")
            self.answer_window = (lo, hi)
        if any(len(pair) != 2 for pair in (c.constraints or [])):
            raise ConfigError(f"strategy.constraints={c.constraints} must be a list of [position, token_id] pairs")
        self.constraints: Dict[int, int] = {int(p): int(t) for p, t in (c.constraints or [])}
        for pos in self.constraints:
            if not 0 <= pos < self.gen_length:
                raise ConfigError(f"strategy.constraints: position {pos} is outside [0, gen_length={self.gen_length})")

    @classmethod
    def config_from_reference(cls, kw: dict, prompt_len: int = 0, gen_length: int = 128) -> EarlyExitConfig:
        """Prophet ``generate`` kwargs -> config (``answer_start_pos`` is absolute: prompt_len + offset)."""
        kw = dict(kw)
        start = kw.pop("answer_start_pos", None)
        if not kw.pop("analyze_gap", False) or start is None:
            start = None
        else:  # an answer window outside the generation disables the test, as in the reference
            start = int(start) - int(prompt_len)
            if max(start, 0) >= min(start + kw.get("answer_length", 5), gen_length):
                start = None
        thr = dict(kw.pop("early_exit_thresholds", None) or {})
        cons = kw.pop("constraints", None)
        cons = [[int(p), int(t)] for p, t in (cons.items() if isinstance(cons, dict) else cons)] if cons else None
        return EarlyExitConfig(answer_start=start, constraints=cons, early_threshold=thr.get("early", 7.5),
                               mid_threshold=thr.get("mid", 5.0), late_threshold=thr.get("late", 2.5), **kw)

    def prepare_canvas(self, canvas) -> None:
        """Write the constraints (idempotent); they count as given tokens."""
        cons = self.constraints
        if cons:
            cols = torch.tensor([canvas.gen_start + int(p) for p in cons], device=canvas.device)
            canvas.set_given(cols, torch.tensor([int(t) for t in cons.values()], device=canvas.device))

    def init_state(self, canvas):
        self.prepare_canvas(canvas)
        return ExitState(BlockCursor(), torch.zeros(canvas.batch_size, dtype=torch.bool, device=canvas.device))

    def plan(self, canvas, st: ExitState) -> Optional[StepPlan]:
        cur = st.cursor
        if cur.block >= self.num_blocks or bool(st.exited.all()):
            return None
        s, e = block_range(canvas, cur.block, self.block_length)
        if cur.step == 0:
            cur.schedule = transfer_schedule(canvas.masked()[:, s:e].sum(-1), self.steps_per_block)
        c = self.cfg
        # the window is the whole generation: the answer window and the all-in commit reach past the block
        return StepPlan(window=(canvas.gen_start, canvas.length), temperature=c.temperature,
                        confidence="random" if c.remasking == "random" else "prob", cfg_scale=c.cfg_scale,
                        cache=CacheDirective(block=(s, e), block_start=cur.step == 0, step_in_block=cur.step))

    def phase_threshold(self, global_step: int) -> float:
        q = global_step / self.steps
        name = next(n for bound, n in PHASES if q < bound)
        return float(getattr(self.cfg, f"{name}_threshold"))

    def answer_gap(self, logits: torch.Tensor) -> torch.Tensor:
        """Mean top-1 minus top-2 raw logit over the answer window ([B], float64, summed in order)."""
        lo, hi = self.answer_window
        top2 = torch.topk(logits[:, lo:hi], 2, dim=-1).values
        diff = (top2[..., 0] - top2[..., 1]).to(torch.float64)       # differences in model dtype
        total = torch.zeros_like(diff[:, 0])
        for j in range(hi - lo):                                     # <= answer_length, sequential as the reference
            total = total + diff[:, j]
        return total / (hi - lo)

    def select(self, canvas, plan, proposal, st: ExitState):
        cur = st.cursor
        s, e = block_range(canvas, cur.block, self.block_length)
        cand = candidates(canvas, proposal, e)
        k = cur.schedule[:, cur.step]
        commit = topk_commit(proposal.confidence, cand, k)
        scalars = {"block": cur.block, "committed": commit.sum(-1)}
        if self.answer_window is not None:
            gap = self.answer_gap(proposal.logits)
            thr = self.phase_threshold(canvas.step + 1)
            fire = (gap >= thr) & ~st.exited
            all_in = canvas.masked()[:, canvas.gen_start:] & fire[:, None]
            commit = torch.where(fire[:, None], all_in, commit)
            st.exited = st.exited | fire
            scalars.update(gap=gap, exit_threshold=thr, exit=fire, committed=commit.sum(-1))
        events = [BlockEvent("opened", cur.block, s, e)] if cur.step == 0 else []
        cur.step += 1
        if cur.step >= self.steps_per_block:
            events.append(BlockEvent("completed", cur.block, s, e))
            cur.block, cur.step = cur.block + 1, 0
        return self.delta(canvas, proposal, commit, events=events, scalars=scalars), st

    def reference_extra(self, scalars, canvas) -> dict:
        """Prophet's ``exit_info`` for row 0."""
        steps = [i + 1 for i, sc in enumerate(scalars) if "exit" in sc and bool(sc["exit"][0])]
        return {"exit_info": {"early_exit_triggered": bool(steps), "exit_decision_step": steps[0] if steps else None,
                              "total_steps": self.steps, "actual_steps": len(scalars)}}
