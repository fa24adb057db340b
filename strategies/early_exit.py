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

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dlm_engine.core.canvas import FrameDelta
from dlm_engine.core.devices import host_tensor
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.confidence import ConfidenceKind, Remasking, ranking
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.blockwise import block_counts, host_rows
from dlm_engine.core.selection import host_schedule, topk_commit
from dlm_engine.core.strategy import (BlockCursor, CacheDirective, StepPlan, Strategy, block_range,
                                      candidates, evolve)
from dlm_engine.errors import ConfigError

# 0 is admitted: every row exits at its first check (the reference takes any value; tests use it to force exits)
LOGIT_GAP = ConfidenceKind("the answer window's mean top-1 minus top-2 logit gap", 0.0, math.inf,
                           passes_all="it is below any gap", low_admitted=True)
PHASES = ((0.33, "early"), (0.67, "mid"), (float("inf"), "late"))


@dataclass
class EarlyExitConfig:
    steps: Optional[int] = None             # total over all blocks; null = gen_length
    block_length: Optional[int] = None      # null = gen_length (a single block)
    temperature: float = 0.0
    remasking: Remasking = Remasking.low_confidence   # low_confidence | random
    cfg_scale: float = 0.0
    answer_start: Optional[int] = None      # answer window start, offset from the generation start; null = never exit
    answer_length: int = 5                  # answer window size (Prophet hard-codes 5)
    early_threshold: float = 7.5            # logit gap needed to exit while global_step/steps < 0.33
    mid_threshold: float = 5.0              # ... < 0.67
    late_threshold: float = 2.5             # ... afterwards
    constraints: Optional[List[List[int]]] = None  # [[generation position, token id], ...], given tokens


@dataclass(frozen=True)
class TransferPlan:
    """The step's transfer count per row (its schedule's entry)."""

    k: Sequence[int]


@dataclass(frozen=True)
class ExitState:
    cursor: BlockCursor
    exited: torch.Tensor                     # [B] bool: rows that went all-in
    schedule: Tuple[Tuple[int, ...], ...] = ()    # the current block's transfer schedule per row (host)
    counts: Tuple[Tuple[int, ...], ...] = ()      # last host read: masked positions per row and block
    all_exited: bool = False                      # last host read: every row went all-in


@register_strategy("early_exit", EarlyExitConfig)
class EarlyExit(Strategy):
    offers = caps(Cap.BLOCKS)
    needs = caps(Cap.WINDOW_LOGITS)          # the answer window and the all-in commit read the whole generation

    def validate(self) -> None:
        c = self.cfg
        self.block_length = self.block_length_or_gen(c.block_length)
        self.num_blocks = self.gen_length // self.block_length
        self.steps = self.gen_length if c.steps is None else int(c.steps)
        self.steps_per_block = self.check_steps_per_block(self.steps, self.num_blocks)
        self.check_non_negative("temperature", c.temperature)
        self.check_non_negative("cfg_scale", c.cfg_scale)
        self.check_positive("answer_length", c.answer_length)
        for phase in ("early", "mid", "late"):     # compared with a mean logit gap, >= 0 and unbounded
            self.check_threshold(f"{phase}_threshold", getattr(c, f"{phase}_threshold"), LOGIT_GAP)
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
        for pos, tok in self.constraints.items():
            if not 0 <= pos < self.gen_length:
                raise ConfigError(f"strategy.constraints: position {pos} is outside [0, gen_length={self.gen_length})")
            if tok < 0:
                raise ConfigError(f"strategy.constraints: token id {tok} at position {pos} is negative")

    def prepare(self, canvas) -> Optional[FrameDelta]:
        """The constraints as a step-0 delta: given tokens at their generation positions."""
        if not self.constraints:
            return None
        B, G, g = canvas.batch_size, canvas.gen_length, canvas.gen_start
        commit = torch.zeros((B, G), dtype=torch.bool, device=canvas.device)
        tokens = canvas.tokens[:, g:].clone()
        cols = host_tensor(list(self.constraints), torch.long, canvas.device)
        commit[:, cols] = True
        tokens[:, cols] = host_tensor(list(self.constraints.values()), tokens.dtype, canvas.device)
        none = torch.zeros(B, dtype=torch.bool, device=canvas.device)
        return FrameDelta(step=0, nfe=0, start=g, commit=commit, tokens=tokens, active=~none, finished=none,
                          scalars={"constraints": len(self.constraints)})

    def init_state(self, canvas):
        return ExitState(BlockCursor(), torch.zeros(canvas.batch_size, dtype=torch.bool, device=canvas.device))

    def plan(self, canvas, st: ExitState):
        cur = st.cursor
        if cur.block >= self.num_blocks or st.all_exited:     # (Prophet stops once every row went all-in)
            return None, st
        s, e = block_range(canvas, cur.block, self.block_length)
        if cur.step == 0:
            st = evolve(st, schedule=host_schedule([row[cur.block] for row in st.counts], self.steps_per_block))
        c = self.cfg
        if self.answer_window is None:      # LLaDA's loop: the block is all a step needs
            window, masked = (s, e), [row[cur.block] for row in st.counts]
        else:
            # the answer window and the all-in commit reach past the block: the whole generation, with
            # confidences at its masked positions (all of them may be committed by an all-in)
            window, masked = (canvas.gen_start, canvas.length), [sum(row) for row in st.counts]
        return StepPlan(window=window, temperature=c.temperature,
                        confidence=ranking(c.remasking), cfg_scale=c.cfg_scale,
                        cache=CacheDirective(block=(s, e), block_start=cur.step == 0, step_in_block=cur.step),
                        masked=masked, data=TransferPlan([sch[cur.step] for sch in st.schedule])), st

    # -- what the next plan must know: masked positions per row and block, and which rows went all-in ----------
    def reads(self, canvas, st: ExitState):
        return [block_counts(canvas, self.block_length), st.exited]     # (the loop's cat reads the flags as 0/1)

    def settle(self, canvas, st: ExitState, values, delta):
        B = canvas.batch_size
        return evolve(st, counts=host_rows(values[:-B], B), all_exited=all(values[-B:]))

    def phase_threshold(self, global_step: int) -> float:
        q = global_step / self.steps
        name = next(n for bound, n in PHASES if q < bound)
        return float(getattr(self.cfg, f"{name}_threshold"))

    def answer_gap(self, logits: torch.Tensor) -> torch.Tensor:
        """Mean top-1 minus top-2 raw logit over the answer window ([B], float64): the differences, taken in model
        dtype, summed one after the other from 0.0 in float64 (as the reference sums them), over the window's
        length."""
        lo, hi = self.answer_window
        first, second = torch.topk(logits[:, lo:hi], 2, dim=-1).values.unbind(-1)
        total = torch.zeros(first.shape[0], dtype=torch.float64, device=logits.device)
        for d in (first - second).to(torch.float64).unbind(-1):     # <= answer_length columns, in order
            total = total + d
        return total / (hi - lo)

    def select(self, canvas, plan, proposal, st: ExitState):
        cur = st.cursor
        s, e = block_range(canvas, cur.block, self.block_length)
        if self.answer_window is None:
            cand = candidates(canvas, proposal, e)
        else:
            # the window is the generation: its masked positions are the all-in commit, those before the block's
            # end (and computed) the candidates
            masked = canvas.masked_cols(canvas.gen_start)
            cand = masked.clone()
            cand[:, e - canvas.gen_start:] = False
            if proposal.valid is not None:
                cand &= proposal.valid
        commit = topk_commit(proposal.confidence, cand, plan.data.k, proposal.row_span)
        exited, exit_scalars = st.exited, {}
        if self.answer_window is not None:
            # a row whose answer gap reaches the phase's threshold goes all-in: every masked position, this step
            gap = self.answer_gap(proposal.logits)
            thr = self.phase_threshold(canvas.step + 1)
            fire = (gap >= thr) & ~exited
            exited = exited | fire
            commit = torch.where(fire[:, None], masked, commit)
            exit_scalars = {"gap": gap, "exit_threshold": thr, "exit": fire}
        scalars = {"block": cur.block, "committed": commit.sum(-1), **exit_scalars}
        done = cur.step + 1 >= self.steps_per_block
        nxt, events = cur.advance((s, e), done)
        delta = self.delta(canvas, proposal, commit, events=events, scalars=scalars)
        return delta, evolve(st, cursor=nxt, exited=exited)
