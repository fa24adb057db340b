"""``dream``: Dream's own decoding rules (``diffusion_generate``) and Fast-dLLM's block loop for Dream.

Without ``block_length`` this is Dream's loop (``docs/specs/dream.md`` §4, §6): exactly ``steps`` model calls
over the whole canvas, every mask decoded (prompt masks too: infilling), timesteps
``linspace(1, eps, steps + 1)``; per step ``alg`` decides what to commit:

* ``origin``: every masked position is revealed with probability ``1 - s/t`` (``torch.rand`` per mask);
* ``maskgit_plus`` / ``topk_margin`` / ``entropy``: ``int(n (1 - s/t))`` positions (``n`` = masks per
  row, batch average as in the reference) ranked by the proposal's probability / top-1 minus top-2
  margin / negative entropy, or drawn from ``softmax(conf / alg_temp)`` when ``alg_temp`` is set;
* ``confidence_threshold`` (Fast-dLLM): ``masks / steps`` per step plus the carry-over of the previous
  step, of which rank 0 always and the others only at confidence ``>= threshold``; rejections at the
  last step add steps.

Proposals come from Dream's ``sample_tokens``: temperature, top-p, top-k, then a categorical draw
(``T > 0``) or argmax (:func:`dlm_engine.core.sampler.filtered_probs`, :func:`~dlm_engine.core.sampler.draw_tokens`).

With ``block_length`` it is Fast-dLLM's block loop for Dream (§7): per block one full call that
commits the block's first position unconditionally, then cached calls (use ``cache=prefix`` or
``cache=dual``) that either fill the block by ``threshold`` (``alg=confidence_threshold``) or follow
the timestep schedule ``ts[1..S]`` with negative-entropy confidence (any other ``alg``; the reference
ignores the name). ``window`` = ``rest`` (the block and everything after it, as Fast-dLLM's
prefix-cache loop sees it) or ``block`` (the block only, as its dual-cache loop): it only changes which
masks are sampled at ``T > 0`` and the width of ``alg_temp`` draws, i.e. RNG parity.

Reference quirks reproduced by default: the batch-average ``n`` (a row with fewer masks than ``k``
gets non-masked positions re-masked), the wasted call and leftover masks of a block with ``S = 1``,
the first step of ``steps = masks`` committing nothing. Beyond the reference, ``confidence_threshold``
and the block loop run per row on batches (the reference supports batch size 1 there).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Tuple

import numpy as np
import torch

from dlm_engine.core.blockwise import block_counts, host_rows
from dlm_engine.core.canvas import BlockEvent, FrameDelta
from dlm_engine.core.devices import host_tensor
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.confidence import Confidence
from dlm_engine.core.sampler import sample_positions, sample_tokens
from dlm_engine.core.selection import masked_order
from dlm_engine.core.strategy import CacheDirective, StepPlan, Strategy, evolve
from dlm_engine.errors import ConfigError
from dlm_engine.strategies._dream_blocks import DreamBlockLoop, DreamPlan


class Alg(str, Enum):
    """Dream's ``alg``: a commit rule (``origin``, ``confidence_threshold``) or, for the timestep schedule, the
    confidence kind it ranks by -- those three are :class:`Confidence` kinds under the reference's names
    (``Confidence(alg)`` maps them: maskgit_plus -> prob, topk_margin -> margin)."""

    origin = "origin"
    maskgit_plus = "maskgit_plus"
    topk_margin = "topk_margin"
    entropy = "entropy"
    confidence_threshold = "confidence_threshold"


class Window(str, Enum):
    block = "block"
    rest = "rest"


@dataclass
class DreamConfig:
    alg: Alg = Alg.entropy                # origin | maskgit_plus | topk_margin | entropy | confidence_threshold
    steps: Optional[int] = None           # model calls (total over blocks); null = gen_length
    eps: float = 1e-3                     # last timestep: ts = linspace(1, eps, steps + 1)
    temperature: float = 0.0              # categorical sampling temperature; 0 = argmax
    top_p: Optional[float] = None         # nucleus filter before sampling (also reshapes confidences)
    top_k: Optional[int] = None           # top-k filter before sampling
    alg_temp: Optional[float] = None      # null/0: commit the top-k positions; > 0: draw them from softmax(conf/alg_temp)
    threshold: float = 0.9                # confidence_threshold: commit rank >= 1 only at confidence >= threshold
    block_length: Optional[int] = None    # null: Dream's loop; set: Fast-dLLM's block loop for Dream
    window: Window = Window.block         # block loop: block | rest (what cached calls sample over; RNG parity)
    infill: bool = True                   # decode mask tokens inside prompts (Dream's loop decodes every mask)


@dataclass(frozen=True)
class DreamState:
    i: int = 0                                  # model calls made (Dream's loop) / within the block (block loop)
    block: int = 0
    block_start: bool = True
    steps_row: Optional[torch.Tensor] = None    # confidence_threshold: per-row (possibly grown) steps
    quota: Optional[torch.Tensor] = None        # confidence_threshold: per-row tokens per step
    carry: Optional[torch.Tensor] = None        # confidence_threshold: per-row rejected tokens carried over
    lo: Optional[int] = None                    # first column that can hold a mask (window start; host read)
    # as of the last host read:
    masks: Tuple[int, ...] = ()                 # Dream's loop: masks per row in [lo, L)
    kmax: int = 0                               # confidence_threshold: the most tokens a row may commit next
    steps_max: int = 0                          # confidence_threshold: the longest (grown) step budget
    blocks: Tuple[Tuple[int, ...], ...] = ()    # block loop: masks per row and block
    win: Tuple[int, ...] = ()                   # block loop: masks per row in the cached steps' window
    inner: Tuple[int, ...] = ()                 # block loop: masks per row in the block after its first column
    check: bool = False                         # block loop: the host read decides whether the block is done


@register_strategy("dream", DreamConfig)
class Dream(DreamBlockLoop, Strategy):
    # -- configuration ---------------------------------------------------------------------------------
    def cache_hint(self, cache) -> Optional[str]:
        """Dream's own loop pairs with no block cache; its block loop (``strategy.block_length``) may."""
        if self.cfg.block_length is not None:
            return None
        import dataclasses

        from dlm_engine.core.capabilities import incompatibility

        try:
            blocks = type(self)(dataclasses.replace(self.cfg, block_length=self.gen_length), self.gen_length)
        except Exception:   # (a setting the block loop refuses: no hint)
            return None
        if incompatibility(blocks, cache) is not None:
            return None
        return (f"strategy.block_length=N (Fast-dLLM's block loop for Dream; N divides gen_length={self.gen_length}) "
                f"enables cache={cache.name}")

    def validate(self) -> None:
        c = self.cfg
        self.steps = self.gen_length if c.steps is None else int(c.steps)
        if self.steps <= 0:
            raise ConfigError(f"strategy.steps={c.steps} must be a positive integer")
        if not (0.0 < float(c.eps) < 1.0):
            raise ConfigError(f"strategy.eps={c.eps} is outside (0, 1)")
        self.check_non_negative("temperature", c.temperature)
        if c.top_p is not None and not (0.0 < float(c.top_p) <= 1.0):
            raise ConfigError(f"strategy.top_p={c.top_p} is outside (0, 1]")
        if c.top_k is not None and int(c.top_k) <= 0:
            raise ConfigError(f"strategy.top_k={c.top_k} must be a positive integer")
        if c.alg_temp is not None and c.alg_temp < 0:
            raise ConfigError(f"strategy.alg_temp={c.alg_temp} must be >= 0 (null or 0 = top-k positions)")
        self.check_threshold("threshold", c.threshold)     # confidence_threshold: a probability, (0, 1]
        if c.block_length is None:
            # Dream's loop: no block structure for a cache, logits over the whole canvas
            self.offers, self.needs = caps(), caps(Cap.WINDOW_LOGITS)
            self.num_blocks = 0
            if c.alg == Alg.confidence_threshold and self.gen_length % self.steps != 0:
                raise ConfigError(f"strategy.alg=confidence_threshold needs gen_length={self.gen_length} "
                                  f"divisible by strategy.steps={self.steps}")
        else:
            self.offers = caps(Cap.BLOCKS)
            self.needs = caps(Cap.SUFFIX_LOGITS if c.window == Window.rest else Cap.BLOCK_LOGITS)
            self.block_length = self.block_length_or_gen(c.block_length)
            self.num_blocks = self.gen_length // self.block_length
            self.check_steps_per_block(self.steps, self.num_blocks)
        self.steps_per_block = self.steps // max(self.num_blocks, 1)
        n = self.steps_per_block if c.block_length is not None else self.steps
        # the reference's float32 timesteps (computed on the CPU, where the fixtures were made); the schedule's
        # float32 arithmetic runs on the host, in numpy
        self.ts = torch.linspace(1, float(c.eps), n + 1, dtype=torch.float32).numpy()

    # -- set-up ----------------------------------------------------------------------------------------
    def prepare(self, canvas) -> Optional[FrameDelta]:
        """Dream's loop decodes every mask, prompt masks included (infilling): they are re-masked at step 0."""
        if self.cfg.block_length is not None or not self.cfg.infill:
            return None
        holes = (canvas.tokens == canvas.mask_id) & (canvas.step_of == 0)
        if not bool(holes.any()):
            return None
        B = canvas.batch_size
        none = torch.zeros(B, dtype=torch.bool, device=canvas.device)
        return FrameDelta(step=0, nfe=0, start=0, commit=torch.zeros_like(holes), tokens=canvas.tokens.clone(),
                          active=~none, finished=none, remask=holes, scalars={"infill": holes.sum(-1)})

    def init_state(self, canvas) -> DreamState:
        return DreamState()

    # -- what the next plan must know: masks per row (and block), counted on the canvas -------------------
    def reads(self, canvas, st: DreamState):
        m = canvas.masked()
        if self.cfg.block_length is not None:
            bs, be = self._block(canvas, min(st.block, self.num_blocks - 1))
            end = canvas.length if self.cfg.window == Window.rest else be
            return [block_counts(canvas, self.block_length), m[:, bs + 1:end].sum(-1), m[:, bs + 1:be].sum(-1)]
        if st.lo is None:                       # before the first step: the window start, masks per row
            cols = m.any(0)
            first = torch.where(cols.any(), cols.int().argmax(), canvas.gen_start)
            return [first, m.sum(-1)]
        parts = [m[:, st.lo:].sum(-1)]
        if st.steps_row is not None:
            # confidence_threshold: the most tokens a row may commit next and the longest step budget (the carried
            # rejections live in the state, not on the canvas)
            want = torch.where(st.i < st.steps_row, st.quota + st.carry, torch.zeros_like(st.quota))
            parts += [want.max(), st.steps_row.max()]
        return parts                            # (read in order, in the loop's one cat)

    def settle(self, canvas, st: DreamState, values, delta):
        B = canvas.batch_size
        ints = [int(v) for v in values]
        if self.cfg.block_length is not None:
            nb = self.num_blocks
            blocks = host_rows(ints[:B * nb], B)
            st = evolve(st, blocks=blocks, win=tuple(ints[B * nb:B * nb + B]), inner=tuple(ints[B * nb + B:]))
            if not st.check:
                return st
            bs, be = self._block(canvas, st.block)
            if any(row[st.block] for row in blocks):
                return evolve(st, i=st.i + 1, check=False)
            delta.block_events.append(BlockEvent("completed", st.block, bs, be))
            return evolve(st, block=st.block + 1, block_start=True, i=0, check=False)
        if st.lo is None:
            lo, masks = ints[0], tuple(ints[1:])
            st = evolve(st, lo=lo, masks=masks)
            if self.cfg.alg != Alg.confidence_threshold:
                return st
            if any(n % self.steps for n in masks):
                raise ConfigError(f"strategy.alg=confidence_threshold: the number of masks per row "
                                  f"({list(masks)}) must be divisible by strategy.steps={self.steps}")
            dev = canvas.device
            quota = host_tensor([n // self.steps for n in masks], torch.long, dev)
            return evolve(st, steps_row=torch.full((B,), self.steps, dtype=torch.long, device=dev),
                          quota=quota, carry=torch.zeros_like(quota),
                          kmax=max(n // self.steps for n in masks), steps_max=self.steps)
        st = evolve(st, masks=tuple(ints[:B]))
        if st.steps_row is not None:
            st = evolve(st, kmax=ints[B], steps_max=ints[B + 1])
        return st

    # -- plan ------------------------------------------------------------------------------------------
    def plan(self, canvas, st: DreamState):
        L = canvas.length
        if self.cfg.block_length is None:
            if st.i >= (st.steps_max if st.steps_row is not None else self.steps):
                return None, st
            return StepPlan(window=(st.lo, L), temperature=0.0, confidence="prob"), st
        if st.block >= self.num_blocks:
            return None, st
        bs, be = self._block(canvas, st.block)
        d = CacheDirective(block=(bs, be), block_start=st.block_start, step_in_block=st.i)
        if st.block_start:
            # at T > 0 the reference draws a token for every canvas position on this call
            window = (0, L) if self.cfg.temperature > 0 else (bs, bs + 1)
        else:
            # column bs is committed; the window starts after it so that every column's source hidden
            # state (j - 1 for a shifted model) lies inside the recomputed span
            end = L if self.cfg.window == Window.rest else be
            window = (min(bs + 1, end), end)
        # rows whose block is already full sit the step out (their trajectory is the one they have alone)
        left = [row[st.block] > 0 for row in st.blocks]
        return StepPlan(window=window, temperature=0.0, confidence="prob", cache=d,
                        rows=None if all(left) else left, data=DreamPlan(left)), st

    # -- select ----------------------------------------------------------------------------------------
    def select(self, canvas, plan, proposal, st: DreamState):
        if self.cfg.block_length is None:
            if self.cfg.alg == Alg.confidence_threshold:
                return self._threshold_step(canvas, plan, proposal, st)
            return self._dream_step(canvas, plan, proposal, st)
        if st.block_start:
            return self._block_start(canvas, plan, proposal, st)
        if self.cfg.alg == Alg.confidence_threshold:
            return self._block_threshold(canvas, plan, proposal, st)
        return self._block_schedule(canvas, plan, proposal, st)

    def _propose(self, logits: torch.Tensor, kind: str = "prob"):
        """Dream's ``sample_tokens`` on rows of logits ``[M, V]``: ``(confidence, x0)``."""
        c = self.cfg
        s = sample_tokens(logits, c.temperature, c.top_p, c.top_k, alg=kind)
        return s.confidence, s.x0

    def _k(self, n: np.float32, i: int, last: int) -> int:
        """``int(n (1 - s/t))`` in float32 (everything left at the last step)."""
        if i < last:
            t, s = self.ts[i], self.ts[i + 1]
            return int(n * (1 - s / t))
        return int(n)

    def _pick(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """``k`` columns per row: top-k of ``scores`` or, with ``alg_temp``, drawn from ``softmax(scores / alg_temp)``."""
        at = self.cfg.alg_temp
        if at is None or at == 0:
            return torch.topk(scores, k, dim=-1).indices
        return sample_positions(scores, k, float(at))

    def _delta(self, canvas, start: int, commit, tokens, conf, *, remask=None, done=False, events=(),
               active=None) -> FrameDelta:
        """A delta over columns ``[start, start + W)``; rows without masks afterwards (or all, when done) finish;
        ``active``: the rows that took part (default: every unfinished row)."""
        m = canvas.masked().clone()
        W = commit.shape[1]
        if remask is not None:
            m[:, start:start + W] |= remask
        m[:, start:start + W] &= ~commit
        finished = (~m.any(-1) | done) & ~canvas.finished
        return FrameDelta(step=canvas.step + 1, nfe=1, start=start, commit=commit, tokens=tokens,
                          active=~canvas.finished if active is None else active & ~canvas.finished,
                          finished=finished, confidence=conf, remask=remask,
                          block_events=list(events), scalars={"committed": commit.sum(-1)})

    @staticmethod
    def _scatter(values: torch.Tensor, where: torch.Tensor, fill, order: torch.Tensor) -> torch.Tensor:
        """``out[where] = values`` with ``order`` from :func:`masked_order` (no host read)."""
        out = torch.full((where.numel(),), fill, dtype=values.dtype, device=values.device)
        return out.index_copy_(0, order, values).view(where.shape)

    # Dream's loop: maskgit_plus / topk_margin / entropy / origin ---------------------------------------
    def _dream_step(self, canvas, plan, proposal, st: DreamState):
        c = self.cfg
        lo = plan.window[0]
        B, W = proposal.x0.shape
        mask = canvas.masked_cols(lo)
        M = sum(st.masks)                                          # masks of the window, known on the host
        order = masked_order(mask, M)
        mask_logits = proposal.logits.reshape(B * W, -1).index_select(0, order)   # [M, V] row-major, as logits[mask_index]
        i, mid = st.i, canvas.mask_id
        nxt = evolve(st, i=st.i + 1)
        done = nxt.i >= self.steps
        if c.alg == Alg.origin:
            p_transfer = float(1 - self.ts[i + 1] / self.ts[i]) if i < self.steps - 1 else 1
            sel = torch.rand(M, device=mask_logits.device) < p_transfer
            if c.temperature > 0:     # the draws have the shape of the revealed positions: one more host read
                x0 = torch.full((M,), mid, dtype=torch.long, device=mask_logits.device)
                _, x0[sel] = self._propose(mask_logits[sel])
            else:                     # argmax: the same tokens whichever rows are proposed
                x0 = torch.where(sel, self._propose(mask_logits)[1], torch.full_like(sel, mid, dtype=torch.long))
            tokens = self._scatter(x0, mask, mid, order)
            commit = mask & (tokens != mid)
            conf = torch.zeros((B, W), dtype=torch.float32, device=tokens.device)
            return self._delta(canvas, lo, commit, tokens, conf, done=done), nxt
        kind = Confidence(c.alg.value)
        cval, x0 = self._propose(mask_logits, kind)
        n = np.float32(M) / np.float32(B)                          # batch average, float32 (reference)
        k = self._k(n, i, self.steps - 1)
        tokens = self._scatter(x0, mask, mid, order)
        conf_w = self._scatter(cval, mask, float("-inf"), order)
        conf = conf_w.float()
        commit = torch.zeros_like(mask)
        if k > 0:
            # ranked over the whole canvas width, as the reference does (matters for alg_temp draws)
            scores = torch.full((B, canvas.length), float("-inf"), dtype=conf_w.dtype, device=conf_w.device)
            scores[:, lo:] = conf_w
            idx = self._pick(scores, k)
            chosen = torch.zeros((B, canvas.length), dtype=torch.bool, device=scores.device)
            chosen.scatter_(1, idx, True)
            if min(st.masks) < k:
                # reference quirk: a row with fewer masks than k gets non-masked positions re-masked
                return self._remask_step(canvas, chosen, tokens, conf, mask, lo, done), nxt
            commit = chosen[:, lo:]
        return self._delta(canvas, lo, commit, tokens, conf, done=done), nxt

    def _remask_step(self, canvas, chosen, tokens_w, conf_w, mask_w, lo, done) -> FrameDelta:
        B, L = chosen.shape
        full_tok = torch.full((B, L), canvas.mask_id, dtype=torch.long, device=chosen.device)
        full_tok[:, lo:] = tokens_w
        full_mask = torch.zeros_like(chosen)
        full_mask[:, lo:] = mask_w
        commit = chosen & full_mask
        remask = chosen & ~full_mask & ~canvas.masked()
        conf = torch.full((B, L), float("-inf"), device=chosen.device)
        conf[:, lo:] = conf_w
        return self._delta(canvas, 0, commit, full_tok, conf, remask=remask, done=done)

    # Fast-dLLM's confidence_threshold in Dream's loop (no blocks) ---------------------------------------
    def _threshold_step(self, canvas, plan, proposal, st: DreamState):
        lo = plan.window[0]
        mask = canvas.masked_cols(lo)
        B, W = mask.shape
        active = st.i < st.steps_row                               # rows whose (grown) step budget lasts
        order = masked_order(mask, sum(st.masks))
        cval, x0 = self._propose(proposal.logits.reshape(B * W, -1).index_select(0, order))
        tokens = self._scatter(x0, mask, canvas.mask_id, order)
        scores = self._scatter(cval, mask, float("-inf"), order)
        want = torch.where(active, st.quota + st.carry, torch.zeros_like(st.quota))
        commit = torch.zeros_like(mask)
        rejected = torch.zeros_like(want)
        kmax = st.kmax                                             # max(want), read on the host
        if kmax > 0:
            vals, idx = torch.topk(scores, kmax, dim=-1)
            rank = torch.arange(kmax, device=scores.device)[None, :]
            inside = rank < want[:, None]
            reject = inside & (rank >= 1) & (vals < self.cfg.threshold)
            commit.scatter_(1, idx, inside & ~reject)
            commit &= mask
            rejected = reject.sum(-1)
        last = active & (st.i == st.steps_row - 1)
        grow = last & (rejected > 0)
        # the reference tests ``i == steps - 1`` per rejected position after growing steps by one, so
        # only the first rejection of a last step extends the budget (one more step, then test again)
        nxt = evolve(st, i=st.i + 1, carry=torch.where(active, rejected, st.carry),
                     quota=torch.where(grow, torch.zeros_like(st.quota), st.quota),
                     steps_row=st.steps_row + grow.long())
        done_rows = nxt.i >= nxt.steps_row
        delta = self._delta(canvas, lo, commit, tokens, scores.float(), done=done_rows.all())
        delta.active = active & ~canvas.finished
        delta.finished = delta.finished | (done_rows & ~canvas.finished)
        return delta, nxt

