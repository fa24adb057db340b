"""``cadllm``: CadLLM — adaptive block size, step budget, vocabulary size and threshold (spec §6).

Blocks are sized from the recent confidence history ``H`` (float32 means), each gets an adaptive step
budget; every step ranks the block's masked positions by a confidence computed over the top-``V_t``
logits only (``V_t`` adapts to progress, ``H`` and repetition of recent tokens) and commits with an
adaptive threshold that relaxes from 0.85 to 0.4 over the block's steps. The block-start step is a full
forward (the reference always runs it with the dual cache: use ``cache=dual``). With
``prophet_enabled`` a block whose confidence gap and confidence stay high is finished by one extra
forward that commits the plain argmax at every masked position (a separate step with temperature 0).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Tuple

import torch

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.sampler import confidence_of, gumbel_argmax
from dlm_engine.core.selection import factor_commit, threshold_commit, topk_commit, transfer_schedule
from dlm_engine.core.strategy import BlockCursor, CacheDirective, Remasking, StepPlan, Strategy, candidates
from dlm_engine.errors import ConfigError
from dlm_engine.strategies import _cadllm_rules as rules


class ConfidenceMethod(str, Enum):
    softmax = "softmax"
    entropy = "entropy"


@dataclass
class CadLLMConfig:
    name: str = "cadllm"
    initial_steps: int = 8               # step budget of a block of initial_block_length
    max_steps: int = 24
    initial_block_length: int = 32
    temperature: float = 0.0
    remasking: Remasking = Remasking.low_confidence    # low_confidence | random
    threshold: Optional[float] = None    # fixed threshold (null: adaptive, or the fixed schedule)
    factor: Optional[float] = None       # factor rule instead of a threshold
    adaptive_blocks: bool = True
    max_block: int = 256
    min_block: int = 8
    confidence_method: ConfidenceMethod = ConfidenceMethod.softmax   # softmax (top-V_t float64) | entropy (1 / (1 + H))
    adaptive_vocab_size: bool = True
    repetition_detection: bool = True
    adaptive_steps: bool = True
    adaptive_threshold: bool = True
    prophet_enabled: bool = False
    min_confidence_gap: float = 0.3
    prophet_patience: int = 2
    min_confidence_commit: float = 0.6


@dataclass(frozen=True)
class CadState:
    next_start: int                           # canvas column where the next block starts
    history: Tuple[float, ...] = ()           # per-step mean confidence of the candidates (whole generation)
    recent: Tuple[int, ...] = ()              # last <= 50 committed token ids (repetition detection)
    cursor: BlockCursor = BlockCursor()       # current (or next) block and the steps taken in it
    start: int = 0                            # current block: canvas columns [start, end)
    end: int = 0
    budget: int = 0                           # step budget of the current block
    progress: float = 0.0                     # fraction of the generation before the current block
    counts: Optional[torch.Tensor] = None     # [B, budget] transfer schedule of the current block
    gaps: Tuple[float, ...] = ()              # Prophet check: top-1 minus top-2 probability per step
    confs: Tuple[float, ...] = ()             # Prophet check: mean confidence per step (after the first)
    open: bool = False
    all_in: bool = False                      # the next step commits the argmax everywhere (Prophet)


@register_strategy("cadllm", CadLLMConfig)
class CadLLM(Strategy):
    max_batch = 1                             # blocks adapt per sequence
    offers = caps(Cap.BLOCKS)
    needs = caps(Cap.BLOCK_LOGITS)

    def validate(self) -> None:
        c = self.cfg
        for key in ("initial_steps", "max_steps", "initial_block_length", "max_block", "min_block",
                    "prophet_patience"):
            self.check_positive(key, getattr(c, key))
        if c.min_block > c.max_block:
            raise ConfigError(f"strategy.min_block={c.min_block} exceeds strategy.max_block={c.max_block}")
        if c.threshold is not None:
            self.check_unit_interval("threshold", c.threshold)
        if c.factor is not None and not float(c.factor) > 0:
            raise ConfigError(f"strategy.factor={c.factor} must be > 0")
        self.check_non_negative("temperature", c.temperature)
        self.vocab_bounds = (15, 5, 35) if c.factor is not None else (100, 35, 1000)

    def init_state(self, canvas):
        return CadState(next_start=canvas.gen_start)

    def threshold_at(self, i: int, steps: int) -> Optional[float]:
        c = self.cfg
        return rules.linear_threshold(i, steps) if c.threshold is None and c.adaptive_threshold else c.threshold

    # -- plan / select --------------------------------------------------------------------------------
    def plan(self, canvas, st: CadState):
        c, G = self.cfg, self.gen_length
        if st.all_in:
            d = CacheDirective(block=(st.start, st.end), block_start=st.cursor.step == 0, step_in_block=st.cursor.step)
            return StepPlan(window=(st.start, st.end), temperature=0.0, confidence="prob", cache=d,
                            info={"allin": True}), st
        if not st.open:
            remaining = canvas.length - st.next_start
            if remaining <= 0:
                return None, st
            size = rules.block_size(st.history, remaining, c.initial_block_length, c.min_block, c.max_block,
                                    c.adaptive_blocks)
            budget = rules.step_budget(st.history, size, c.initial_steps, c.max_steps, c.initial_block_length,
                                       c.adaptive_steps)
            s, e = st.next_start, st.next_start + size
            st = dataclasses.replace(
                st, start=s, end=e, budget=budget, open=True,
                progress=(G - remaining) / G, counts=transfer_schedule(canvas.masked()[:, s:e].sum(-1), budget),
                gaps=(), confs=())
        i = st.cursor.step
        progress = st.progress + (i / st.budget) * ((st.end - st.start) / G)
        v_t = rules.vocab_size(progress, st.history, st.recent, *self.vocab_bounds, c.adaptive_vocab_size,
                               c.repetition_detection)
        kind = "random" if c.remasking == Remasking.random else (
            "prob" if c.confidence_method == ConfidenceMethod.softmax else "inv_entropy")
        d = CacheDirective(block=(st.start, st.end), block_start=i == 0, step_in_block=i)
        return StepPlan(window=(st.start, st.end), temperature=c.temperature, confidence=kind, top_v=v_t, cache=d,
                        info={"vocab_size": v_t, "threshold": self.threshold_at(i, st.budget)}), st

    def select(self, canvas, plan, proposal, st: CadState):
        c = self.cfg
        cand = candidates(canvas, proposal, st.end)
        scalars = {"block": st.cursor.block, "block_size": st.end - st.start, "steps": st.budget}
        bounds = (st.start, st.end)
        if plan.info.get("allin"):               # Prophet-style commit: plain argmax everywhere
            nxt, events = st.cursor.advance(bounds, done=True)
            return (self.delta(canvas, proposal, cand, events=events, scalars=scalars),
                    dataclasses.replace(st, cursor=nxt, all_in=False, open=False, next_start=st.end))
        i = st.cursor.step
        tau, v_t = plan.info["threshold"], plan.info["vocab_size"]
        scalars["vocab_size"] = v_t
        if tau is not None:
            scalars["threshold"] = tau
        conf = proposal.confidence
        if c.factor is not None:
            commit = factor_commit(conf, cand, float(c.factor))
        elif tau is not None:
            commit = threshold_commit(conf, cand, tau)
        else:
            k = st.counts[:, i] if i < st.budget else torch.ones_like(st.counts[:, 0])
            commit = topk_commit(conf, cand, k)
        history, confs, gaps = st.history, st.confs, st.gaps
        if c.remasking == Remasking.low_confidence:     # confidence tracking, with a second Gumbel draw
            x0b = gumbel_argmax(proposal.logits, c.temperature, proposal.call_len,
                                proposal.start - proposal.call_start)
            cb = confidence_of(proposal.logits, x0b, plan.confidence, top_v=plan.top_v)
            if bool(cand.any()):
                history = history + (cb[cand].mean().item(),)
                if i > 0:
                    confs = confs + (history[-1],)
        st = dataclasses.replace(st, history=history, confs=confs)
        if c.prophet_enabled and i > 0:
            p = torch.softmax(proposal.logits, dim=-1).topk(2, dim=-1).values
            gaps = gaps + ((p[..., 0] - p[..., 1]).mean().item(),)
            st = dataclasses.replace(st, gaps=gaps)
            if i > 0.2 * st.budget and self._stable(gaps, confs):
                scalars["prophet_commit"] = True
                return (self.delta(canvas, proposal, torch.zeros_like(cand), scalars=scalars),
                        dataclasses.replace(st, all_in=True))
        if c.repetition_detection:
            st = dataclasses.replace(st, recent=(st.recent + tuple(proposal.x0[commit].tolist()))[-50:])
        done = not bool((cand & ~commit).any())
        nxt, events = st.cursor.advance(bounds, done)
        st = dataclasses.replace(st, cursor=nxt)
        if done:
            st = dataclasses.replace(st, open=False, next_start=st.end)
        return self.delta(canvas, proposal, commit, events=events, scalars=scalars), st

    def _stable(self, gaps: Tuple[float, ...], confs: Tuple[float, ...]) -> bool:
        c, n = self.cfg, self.cfg.prophet_patience
        if len(gaps) < n or len(confs) < n:
            return False
        return all(g > c.min_confidence_gap for g in gaps[-n:]) and \
            all(h > c.min_confidence_commit for h in confs[-n:])
