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

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from dlm_engine.strategies import _cadllm_rules as adaptive
from dlm_engine.core.canvas import BlockEvent
from dlm_engine.errors import ConfigError
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.sampler import confidence_of, gumbel_argmax
from dlm_engine.core.selection import factor_commit, threshold_commit, topk_commit, transfer_schedule
from dlm_engine.core.strategy import CacheDirective, StepPlan, Strategy, candidates


@dataclass
class CadLLMConfig:
    name: str = "cadllm"
    initial_steps: int = 8               # step budget of a block of initial_block_length
    max_steps: int = 24
    initial_block_length: int = 32
    temperature: float = 0.0
    remasking: str = "low_confidence"    # low_confidence | random
    threshold: Optional[float] = None    # fixed threshold (null: adaptive, or the fixed schedule)
    factor: Optional[float] = None       # factor rule instead of a threshold
    adaptive_blocks: bool = True
    max_block: int = 256
    min_block: int = 8
    confidence_method: str = "softmax"   # softmax (top-V_t float64) | entropy (1 / (1 + H))
    adaptive_vocab_size: bool = True
    repetition_detection: bool = True
    adaptive_steps: bool = True
    adaptive_threshold: bool = True
    prophet_enabled: bool = False
    min_confidence_gap: float = 0.3
    prophet_patience: int = 2
    min_confidence_commit: float = 0.6


@dataclass
class CadState:
    pos: int                                  # canvas column where the next block starts
    H: List[float] = field(default_factory=list)  # confidence history (whole generation)
    Q: List[int] = field(default_factory=list)    # last <= 50 committed tokens
    block: int = -1
    s: int = 0
    e: int = 0
    steps: int = 0
    i: int = 0
    progress: float = 0.0
    schedule: Optional[torch.Tensor] = None
    gaps: List[float] = field(default_factory=list)
    confs: List[float] = field(default_factory=list)
    open: bool = False
    allin: bool = False


@register_strategy("cadllm", CadLLMConfig)
class CadLLM(Strategy):
    caches = ("dual", "none", "prefix")
    max_batch = 1                             # blocks adapt per sequence

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
        self.check_choice("remasking", c.remasking, ("low_confidence", "random"))
        self.check_choice("confidence_method", c.confidence_method, ("softmax", "entropy"))
        self.check_non_negative("temperature", c.temperature)
        self.vocab_bounds = (15, 5, 35) if c.factor is not None else (100, 35, 1000)

    def init_state(self, canvas):
        return CadState(pos=canvas.gen_start)

    def threshold_at(self, i: int, steps: int) -> Optional[float]:
        c = self.cfg
        return adaptive.linear_threshold(i, steps) if c.threshold is None and c.adaptive_threshold else c.threshold

    # -- plan / select --------------------------------------------------------------------------------
    def plan(self, canvas, st: CadState) -> Optional[StepPlan]:
        c, G = self.cfg, self.gen_length
        directive = lambda: CacheDirective(block=(st.s, st.e), block_start=st.i == 0, step_in_block=st.i)  # noqa: E731
        if st.allin:
            return StepPlan(window=(st.s, st.e), temperature=0.0, confidence="prob", cache=directive(),
                            info={"allin": True})
        if not st.open:
            remaining = canvas.length - st.pos
            if remaining <= 0:
                return None
            size = adaptive.block_size(st.H, remaining, c.initial_block_length, c.min_block, c.max_block,
                                       c.adaptive_blocks)
            st.block, st.s, st.e, st.i, st.open = st.block + 1, st.pos, st.pos + size, 0, True
            st.steps = adaptive.step_budget(st.H, size, c.initial_steps, c.max_steps, c.initial_block_length,
                                            c.adaptive_steps)
            st.progress = (G - remaining) / G
            st.schedule = transfer_schedule(canvas.masked()[:, st.s:st.e].sum(-1), st.steps)
            st.gaps, st.confs = [], []
        progress = st.progress + (st.i / st.steps) * ((st.e - st.s) / G)
        v_t = adaptive.vocab_size(progress, st.H, st.Q, *self.vocab_bounds, c.adaptive_vocab_size,
                                  c.repetition_detection)
        kind = "random" if c.remasking == "random" else ("prob" if c.confidence_method == "softmax" else "inv_entropy")
        return StepPlan(window=(st.s, st.e), temperature=c.temperature, confidence=kind, top_v=v_t,
                        cache=directive(), info={"vocab_size": v_t, "threshold": self.threshold_at(st.i, st.steps)})

    def select(self, canvas, plan, proposal, st: CadState):
        c = self.cfg
        cand = candidates(canvas, proposal, st.e)
        scalars = {"block": st.block, "block_size": st.e - st.s, "steps": st.steps}
        if plan.info.get("allin"):               # Prophet-style commit: plain argmax everywhere
            return self._finish(canvas, proposal, cand, st, scalars)
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
            k = st.schedule[:, st.i] if st.i < st.steps else torch.ones_like(st.schedule[:, 0])
            commit = topk_commit(conf, cand, k)
        if c.remasking == "low_confidence":     # confidence tracking, with a second Gumbel draw
            x0b = gumbel_argmax(proposal.logits, c.temperature, proposal.call_len,
                                proposal.start - proposal.call_start)
            cb = confidence_of(proposal.logits, x0b, plan.confidence, top_v=plan.top_v)
            if bool(cand.any()):
                st.H.append(cb[cand].mean().item())
                if st.i > 0:
                    st.confs.append(st.H[-1])
        if c.prophet_enabled and st.i > 0:
            p = torch.softmax(proposal.logits, dim=-1).topk(2, dim=-1).values
            st.gaps.append((p[..., 0] - p[..., 1]).mean().item())
            if st.i > 0.2 * st.steps and self._stable(st):
                st.allin, scalars["prophet_commit"] = True, True
                return self.delta(canvas, proposal, torch.zeros_like(cand), scalars=scalars), st
        if c.repetition_detection:
            st.Q = (st.Q + proposal.x0[commit].tolist())[-50:]
        events = [BlockEvent("opened", st.block, st.s, st.e)] if st.i == 0 else []
        st.i += 1
        if not bool((cand & ~commit).any()):
            events.append(self._close(st))
        return self.delta(canvas, proposal, commit, events=events, scalars=scalars), st

    def _stable(self, st: CadState) -> bool:
        c, n = self.cfg, self.cfg.prophet_patience
        if len(st.gaps) < n or len(st.confs) < n:
            return False
        return all(g > c.min_confidence_gap for g in st.gaps[-n:]) and \
            all(h > c.min_confidence_commit for h in st.confs[-n:])

    def _finish(self, canvas, proposal, cand, st: CadState, scalars):
        st.allin = False
        return self.delta(canvas, proposal, cand, events=[self._close(st)], scalars=scalars), st

    def _close(self, st: CadState) -> BlockEvent:
        st.open, st.pos = False, st.e
        return BlockEvent("completed", st.block, st.s, st.e)

    def reference_extra(self, scalars, canvas) -> dict:
        return {"vocab_size_history": [int(s["vocab_size"]) for s in scalars if "vocab_size" in s]}
