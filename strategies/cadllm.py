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

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.sampler import confidence_of, gumbel_argmax
from dlm_engine.core.selection import factor_commit, host_schedule, masked_order, threshold_commit, topk_commit
from dlm_engine.core.confidence import Confidence, Remasking, check_kind, ranking
from dlm_engine.core.strategy import BlockCursor, CacheDirective, StepPlan, Strategy, candidates, evolve
from dlm_engine.errors import ConfigError
from dlm_engine.strategies import _cadllm_rules as rules


@dataclass
class CadLLMConfig:
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
    confidence_method: Confidence = Confidence.softmax   # softmax = prob (top-V_t float64) | entropy (1 / (1 + H))
    adaptive_vocab_size: bool = True
    repetition_detection: bool = True
    adaptive_steps: bool = True
    adaptive_threshold: bool = True
    prophet_enabled: bool = False
    min_confidence_gap: float = 0.3
    prophet_patience: int = 2
    min_confidence_commit: float = 0.6


@dataclass(frozen=True)
class CadPlan:
    """What a step's select needs: ``all_in`` (the Prophet-style commit of every candidate), else the step's
    top-V vocabulary size and threshold (None: no threshold)."""

    all_in: bool = False
    vocab_size: Optional[int] = None
    threshold: Optional[float] = None


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
    counts: Tuple[int, ...] = ()              # transfer schedule of the current block (tokens per step)
    masked: Tuple[bool, ...] = ()             # masked generated positions (last host read)
    left: int = 0                             # masked positions left in the current block (last host read)
    gaps: Tuple[float, ...] = ()              # Prophet check: top-1 minus top-2 probability per step
    confs: Tuple[float, ...] = ()             # Prophet check: mean confidence per step (after the first)
    open: bool = False
    all_in: bool = False                      # the next step commits the argmax everywhere (Prophet)
    # the step's numbers the next host read takes (on the device; each None when the step made none): the Prophet
    # commit test's verdict, the mean confidence of the candidates and the Prophet gap
    pending: Optional[Tuple[Optional[torch.Tensor], ...]] = None


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
        self.check_threshold("threshold", c.threshold, allow_none=True)     # a probability: (0, 1]
        if c.factor is not None and not float(c.factor) > 0:
            raise ConfigError(f"strategy.factor={c.factor} must be > 0")
        self.check_non_negative("temperature", c.temperature)
        check_kind("confidence_method", c.confidence_method, (Confidence.prob, Confidence.entropy, Confidence.inv_entropy))
        self.vocab_bounds = (15, 5, 35) if c.factor is not None else (100, 35, 1000)

    # on a block-causal model (core.capabilities.model_incompatibility) the blocks must be the model's: fixed ones
    fixed_block_key = "strategy.initial_block_length"

    @property
    def adaptive_block_key(self) -> Optional[str]:
        return "strategy.adaptive_blocks" if self.cfg.adaptive_blocks else None

    @property
    def block_length(self) -> int:
        """The block size when blocks are not adaptive."""
        return int(self.cfg.initial_block_length)

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
                            data=CadPlan(all_in=True)), st
        if not st.open:
            remaining = canvas.length - st.next_start
            if remaining <= 0:
                return None, st
            size = rules.block_size(st.history, remaining, c.initial_block_length, c.min_block, c.max_block,
                                    c.adaptive_blocks)
            budget = rules.step_budget(st.history, size, c.initial_steps, c.max_steps, c.initial_block_length,
                                       c.adaptive_steps)
            s, e = st.next_start, st.next_start + size
            g = canvas.gen_start
            left = sum(st.masked[s - g:e - g])
            st = evolve(
                st, start=s, end=e, budget=budget, open=True, left=left,
                progress=(G - remaining) / G, counts=host_schedule([left], budget)[0], gaps=(), confs=())
        i = st.cursor.step
        progress = st.progress + (i / st.budget) * ((st.end - st.start) / G)
        v_t = rules.vocab_size(progress, st.history, st.recent, *self.vocab_bounds, c.adaptive_vocab_size,
                               c.repetition_detection)
        # CadLLM's entropy kind is the sampler's 1 / (1 + H) over the top-V logits
        kind = ranking(c.remasking, Confidence.inv_entropy if c.confidence_method == Confidence.entropy
                       else c.confidence_method)
        d = CacheDirective(block=(st.start, st.end), block_start=i == 0, step_in_block=i)
        return StepPlan(window=(st.start, st.end), temperature=c.temperature, confidence=kind, top_v=v_t, cache=d,
                        masked=[st.left], data=CadPlan(vocab_size=v_t, threshold=self.threshold_at(i, st.budget))), st

    def select(self, canvas, plan, proposal, st: CadState):
        c = self.cfg
        cand = candidates(canvas, proposal, st.end)
        scalars = {"block": st.cursor.block, "block_size": st.end - st.start, "steps": st.budget}
        bounds = (st.start, st.end)
        if plan.data.all_in:               # Prophet-style commit: plain argmax everywhere
            nxt, events = st.cursor.advance(bounds, done=True)
            return (self.delta(canvas, proposal, cand, events=events, scalars=scalars),
                    evolve(st, cursor=nxt, all_in=False, open=False, next_start=st.end, pending=None))
        i = st.cursor.step
        tau, v_t = plan.data.threshold, plan.data.vocab_size
        scalars["vocab_size"] = v_t
        if tau is not None:
            scalars["threshold"] = tau
        conf = proposal.confidence
        # n: the candidates' number -- the block's masked positions (the last host read; CadLLM decodes one row),
        # counted when a cache left block columns out. The threshold rule's top-1 is the first of torch.topk over
        # that many, as the reference ranks (exact ties: the zero confidences at T > 0)
        n = st.left if proposal.valid is None else int(cand.sum())
        span = proposal.row_span
        if c.factor is not None:
            commit = factor_commit(conf, cand, float(c.factor), span)
        elif tau is not None:
            commit = threshold_commit(conf, cand, tau, span, [n])
        else:
            commit = topk_commit(conf, cand, [st.counts[i] if i < st.budget else 1], span)
        mean = gap = stable = None
        if c.remasking == Remasking.low_confidence:     # confidence tracking, with a second Gumbel draw at T > 0
            if c.temperature > 0:
                x0b = gumbel_argmax(proposal.logits, c.temperature, proposal.call_len,
                                    proposal.start - proposal.call_start)
                cb = confidence_of(proposal.logits, x0b, plan.confidence, top_v=plan.top_v)
            else:                                    # the same argmax: the proposal's confidences are the pass
                cb = conf
            # cb[cand].mean() (the reference's order and length: the same float; NaN without a candidate), gathered
            # by the candidates' number n so that the step reads the host once, in the loop's read
            mean = cb.reshape(-1)[masked_order(cand, n)].mean()
        if c.prophet_enabled and i > 0:
            p = torch.softmax(proposal.logits, dim=-1).topk(2, dim=-1).values
            gap = (p[..., 0] - p[..., 1]).mean()
            if i > 0.2 * st.budget:
                stable = self._stable_now(st, gap, mean, n)
                commit = commit & ~stable
                scalars["prophet_commit"] = stable
        delta = self.delta(canvas, proposal, commit, scalars=scalars)
        return delta, evolve(st, pending=(stable, mean, gap))

    def _stable_now(self, st: CadState, gap: torch.Tensor, mean: Optional[torch.Tensor], n: int) -> torch.Tensor:
        """The Prophet check with this step's gap and mean confidence still on the device: the earlier values
        are host numbers, so the device decides with one comparison each."""
        c, k = self.cfg, self.cfg.prophet_patience
        gaps_ok = len(st.gaps) + 1 >= k and all(g > c.min_confidence_gap for g in st.gaps[len(st.gaps) - k + 1:])
        if mean is not None and n > 0:             # this step's confidence joins the window
            confs_ok = len(st.confs) + 1 >= k and all(h > c.min_confidence_commit
                                                      for h in st.confs[len(st.confs) - k + 1:])
            conf_now = mean > c.min_confidence_commit
        else:
            confs_ok = len(st.confs) >= k and all(h > c.min_confidence_commit for h in st.confs[-k:])
            conf_now = True
        if not (gaps_ok and confs_ok):
            return gap.new_zeros((), dtype=torch.bool)
        return (gap > c.min_confidence_gap) & conf_now

    # -- what the next plan must know ------------------------------------------------------------------------
    def reads(self, canvas, st: CadState):
        """Row 0's generated ``step_of`` (masked: < 0), then after a step: the block's tokens (repetition detection:
        the committed ones are the columns masked before the step and not after it), the Prophet verdict, the mean
        confidence and the gap. (The loop's one cat promotes to int64, or to float64 with a float part: exact for
        these ints; it flattens 0-d parts.)"""
        parts = [canvas.cols(canvas.gen_start, canvas.length)[1][0]]
        if st.pending is not None:
            if self.cfg.repetition_detection:
                parts.append(canvas.cols(st.start, st.end)[0][0])
            stable, mean, gap = st.pending
            parts += [x if x.dtype == torch.bool else x.to(torch.float64) for x in (stable, mean, gap) if x is not None]
        return parts

    def settle(self, canvas, st: CadState, values, delta):
        G, g = self.gen_length, canvas.gen_start
        before = st.masked
        masked = tuple(v < 0 for v in values[:G])
        st = evolve(st, masked=masked)
        if st.pending is None:                       # before the first step, or after an all-in step
            return st
        c = self.cfg
        stable, mean, gap = st.pending
        rest = list(values[G:])
        s, e = st.start - g, st.end - g
        tokens = ()
        if c.repetition_detection:
            tokens, rest = rest[:e - s], rest[e - s:]
        stable = stable is not None and bool(rest.pop(0))
        i = st.cursor.step
        history, confs, gaps = st.history, st.confs, st.gaps
        if mean is not None:
            m = rest.pop(0)
            if m == m:                               # NaN: no candidate this step
                history = history + (m,)
                if i > 0:
                    confs = confs + (m,)
        if gap is not None:
            gaps = gaps + (rest.pop(0),)
        left = sum(masked[s:e])
        st = evolve(st, history=history, confs=confs, gaps=gaps, pending=None, left=left)
        if stable:
            return evolve(st, all_in=True)
        if c.repetition_detection:                   # the block's columns committed by this step, in order
            new = tuple(int(t) for t, was, now in zip(tokens, before[s:e], masked[s:e]) if was and not now)
            st = evolve(st, recent=(st.recent + new)[-50:])
        done = left == 0                             # the block's steps go on while it has a mask
        nxt, events = st.cursor.advance((st.start, st.end), done)
        delta.block_events += events
        st = evolve(st, cursor=nxt)
        if done:
            st = evolve(st, open=False, next_start=st.end)
        return st
