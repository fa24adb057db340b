"""``wino``: WINO -- wide-in, narrow-out decoding with re-masking (docs/specs/d2cache.md §7).

Blocks are decoded in order. Every step sees the block window twice in one forward: the canvas itself, and a
*shadow* copy of the window appended after the canvas (all masks, the window's positions) whose slot ``i``
may not look at window position ``i``. Masked slots are proposed from the canvas, decoded slots are re-scored
from their shadow slot (the probability of the token in place). *Wide in*: every masked slot scoring
``>= wide_in_thres`` is committed (at least ``num_transfer_tokens``, at most ``clamp(0.7 n, 5, 20)``).
*Narrow out*: decoded slots scoring ``< narrow_out_thres`` are re-masked, at most ``wide - num_transfer_tokens``
of them (the least confident), so every step makes net progress. A re-masked position is decoded again later;
the delta carries re-masks in ``FrameDelta.remask`` and the trace keeps every write.

The default is the corrected window (the block, every row). ``shrinking_window=true`` reproduces the
reference: its block mask shrinks in place with every step's active-row check, so from the third step the
window is the span of *row 0's* positions that were masked a step earlier, and positions re-masked outside it
are never decoded again (outputs keep [MASK] tokens; the parity command uses this). Also reproduced by default:
a shifted-logit model's (Dream's) shadow slot 0 reads the canvas' last position (``shadow_shift_within=true``
shifts within the shadow block only).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from dlm_engine.core.blockwise import block_counts, host_rows
from dlm_engine.core.canvas import FrameDelta
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.confidence import Confidence, check_kind, sampler_confidence
from dlm_engine.core.priors import CertaintyDensity
from dlm_engine.core.protocol import AuxColumns
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.sampler import ALGS, sample_tokens
from dlm_engine.core.selection import d2c_commit, f32, topk_rows
from dlm_engine.core.strategy import StepPlan, Strategy, evolve, masked_after
from dlm_engine.errors import ConfigError, UserError


@dataclass
class WinoConfig:
    block_length: Optional[int] = None          # null = gen_length (one block)
    num_transfer_tokens: int = 1                # net progress per step (at least)
    wide_in_thres: float = 0.7                  # commit masked slots scoring >= this (the reference yaml's value)
    narrow_out_thres: float = 0.9               # re-mask decoded slots scoring < this
    alg: Confidence = Confidence.maskgit_plus   # maskgit_plus = prob | topk_margin = margin | entropy | random
    temperature: float = 0.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    sigma: Optional[float] = None               # certainty prior on the wide-in scores
    shrinking_window: bool = False              # quirks 3/10: the reference's row-0, in-place-shrunk window
    shadow_shift_within: bool = False           # quirk 11: a shifted model's shadow slot 0 reads the last canvas column


@dataclass(frozen=True)
class WinoPlan:
    """Per row that takes part (host): its block's masked positions and its wide-in cap."""

    counts: Sequence[int]
    cap: Sequence[int]


@dataclass(frozen=True)
class WinoState:
    block: int = 0
    block_mask: Optional[torch.Tensor] = None   # [B, G] the reference's in-place-shrunk block mask (shrinking_window)
    window: tuple = (0, 0)                      # generated positions [bs, be) of the step being planned
    counts: Tuple[Tuple[int, ...], ...] = ()    # last host read: masked positions per row and block
    shrunk: Optional[tuple] = None              # last host read (shrinking_window): (rows active, row 0's span,
                                                # masked positions per row in that span) under block_mask
    density: Optional[CertaintyDensity] = None  # the certainty prior's reused rows (sigma set), one per decode


@functools.lru_cache(maxsize=1024)
def wide_cap(n: int, ntt: int) -> int:
    """WINO's most commits for a window with ``n`` masked positions: ``max(clamp(int(0.7 n), 5, 20), ntt)`` with
    ``0.7 n`` a float32 product as the reference computes it (``int(float32(n) * float32(0.7))``, rounded to
    float32 before the truncation: 7 for ``n = 10``, where the double product of the float32 factors is 6.9999...)."""
    return max(min(max(int(f32(f32(n) * f32(0.7))), 5), 20), ntt)


@register_strategy("wino", WinoConfig)
class Wino(Strategy):
    offers = caps()
    needs = caps(Cap.WINDOW_LOGITS, Cap.AUX_COLUMNS)

    def validate(self) -> None:
        c = self.cfg
        self.block_len = self.block_length_or_gen(c.block_length)
        self.num_blocks = self.gen_length // self.block_len
        self.check_positive("num_transfer_tokens", c.num_transfer_tokens)
        # wide-in commits the masked slots whose ``alg`` confidence (never debiased) is >= wide_in_thres; narrow-out
        # re-masks the decoded slots whose probability of their token in place, whatever ``alg`` is, is below
        # narrow_out_thres (docs/thresholds.md)
        check_kind("alg", c.alg, ALGS)
        self.check_threshold("wide_in_thres", c.wide_in_thres, sampler_confidence(c.alg))
        self.check_unit_interval("narrow_out_thres", c.narrow_out_thres)
        self.check_non_negative("temperature", c.temperature)
        if c.top_p is not None and not 0.0 < float(c.top_p) <= 1.0:
            raise ConfigError(f"strategy.top_p={c.top_p} is outside (0, 1]")
        if c.top_k is not None:
            self.check_positive("top_k", c.top_k)
        if c.sigma is not None:
            self.check_non_negative("sigma", c.sigma)

    def init_state(self, canvas) -> WinoState:
        return WinoState(density=CertaintyDensity(self.cfg.sigma) if self.cfg.sigma else None)

    def max_steps(self, canvas) -> int:
        return canvas.gen_length + 8 * self.num_blocks     # each step nets >= num_transfer_tokens commits

    # -- plan ------------------------------------------------------------------------------------------------
    def fresh_mask(self, canvas, block: int) -> torch.Tensor:
        m = torch.zeros((canvas.batch_size, canvas.gen_length), dtype=torch.bool, device=canvas.device)
        m[:, block * self.block_len:(block + 1) * self.block_len] = True
        return m

    def plan(self, canvas, st: WinoState):
        c, g = self.cfg, canvas.gen_start
        while st.block < self.num_blocks:
            if c.shrinking_window and st.block_mask is not None:      # the reference's shrinking window
                rows, (bs, be), n = st.shrunk
            else:
                bs, be = st.block * self.block_len, (st.block + 1) * self.block_len
                n = [row[st.block] for row in st.counts]
                rows = [k > 0 for k in n]
            if any(rows):
                if bs < 0:
                    raise UserError("wino (shrinking_window=true): row 0 has nothing left in its block while another "
                                    "row does -- the reference fails here; use the corrected window")
                break
            st = evolve(st, block=st.block + 1, block_mask=None)
        else:
            return None, st
        mask = None
        if c.shrinking_window:     # the active-row check shrinks the reference's block mask in place
            bm = st.block_mask if st.block_mask is not None else self.fresh_mask(canvas, st.block)
            mask = bm & canvas.masked_cols(g)
        st = evolve(st, block_mask=mask, window=(bs, be))
        run = [k for k, r in zip(n, rows) if r]
        cap = [wide_cap(k, c.num_transfer_tokens) for k in run]
        return StepPlan(window=(g + bs, g + be), sample=False, rows=None if all(rows) else list(rows),
                        aux=self.shadow(canvas, bs, be), position_ids=canvas.position_ids, temperature=c.temperature,
                        data=WinoPlan(run, cap)), st

    def shadow(self, canvas, bs: int, be: int) -> AuxColumns:
        """The shadow block of window ``[bs, be)``: W masks at the window's positions; canvas rows cannot see it,
        shadow slot i cannot see window position i; padding stays invisible to everyone."""
        g, W = canvas.gen_start, be - bs
        B, L = canvas.batch_size, canvas.length
        keys = torch.cat([canvas.attention_mask.bool(), torch.ones((B, W), dtype=torch.bool, device=canvas.device)], 1)
        attend = keys[:, None, :].expand(B, L + W, L + W).clone()
        attend[:, :L, L:] = False
        i = torch.arange(W, device=canvas.device)
        attend[:, L + i, g + bs + i] = False
        return AuxColumns(tokens=torch.full((B, W), canvas.mask_id, dtype=torch.long, device=canvas.device),
                          positions=canvas.position_ids[:, g + bs:g + be], attend=attend,
                          shift_within=self.cfg.shadow_shift_within)

    # -- what the next plan must know ------------------------------------------------------------------------
    def reads(self, canvas, st: WinoState):
        """Masked positions per row and block; with the reference's shrinking window, the rows it leaves out once
        they finish and, under its block mask, the rows still active, row 0's span and the masked positions per row
        in that span."""
        g = canvas.gen_start
        masked = canvas.masked_cols(g)
        if not self.cfg.shrinking_window:
            return block_counts(canvas, self.block_len, masked)
        masked &= ~canvas.finished[:, None]
        parts = [block_counts(canvas, self.block_len, masked)]
        if st.block_mask is not None:
            bm = st.block_mask
            G = bm.shape[1]
            col = torch.arange(G, device=bm.device)
            any0 = bm[0].any()
            first = torch.where(any0, bm[0].int().argmax(), -1)
            last = torch.where(any0, G - 1 - bm[0].flip(0).int().argmax(), -1)
            inside = (col >= first) & (col <= last)
            parts += [(bm & masked).any(-1), first, last, (canvas.masked_cols(g) & inside[None, :]).sum(-1)]
        return parts                       # (the loop's one cat promotes the flags to int64 with the counts)

    def settle(self, canvas, st: WinoState, values, delta):
        B, nb = canvas.batch_size, self.num_blocks
        counts = host_rows(values[:B * nb], B)
        shrunk = None
        if self.cfg.shrinking_window and st.block_mask is not None:
            rest = [int(v) for v in values[B * nb:]]
            first, last = rest[B], rest[B + 1]
            shrunk = ([v > 0 for v in rest[:B]], (first, last + 1) if first >= 0 else (-1, -1), rest[B + 2:])
        return evolve(st, counts=counts, shrunk=shrunk)

    # -- select ----------------------------------------------------------------------------------------------
    def select(self, canvas, plan, proposal, st: WinoState):
        c, g = self.cfg, canvas.gen_start
        bs, be = st.window
        rows = proposal.rows
        masked_w = canvas.masked_cols(g + bs, g + be)
        current = canvas.tokens[:, g + bs:g + be]
        if rows is not None:                               # the call's rows
            masked_w, current = masked_w[rows], current[rows]
        # masked slots are proposed from the canvas, decoded ones scored by their shadow slot
        combined = torch.where(masked_w[..., None], proposal.logits, proposal.aux_logits).to(torch.float64)
        s = sample_tokens(combined, c.temperature, c.top_p, c.top_k, alg=c.alg.value)
        in_place = torch.gather(s.probs, -1, current[..., None]).squeeze(-1)
        conf = torch.where(masked_w, s.confidence, in_place)
        scores = conf
        if c.sigma:
            m = canvas.masked_cols(g)
            dens = st.density.of_masked(m if rows is None else m[rows])[:, bs:be].to(conf.dtype)
            scores = conf * dens
        # wide in: the masked slots scoring >= wide_in_thres, between num_transfer_tokens and the cap of them
        ntt = c.num_transfer_tokens
        wide = d2c_commit(scores, masked_w, ntt, plan.data.cap, counts=plan.data.counts, threshold=c.wide_in_thres)
        # narrow out: the decoded slots scoring < narrow_out_thres, the k least confident of them when more than
        # k = (wide-in commits - num_transfer_tokens) do
        k = (wide.sum(-1) - ntt).clamp_min(0)
        decoded = ~masked_w
        low = decoded & (conf < c.narrow_out_thres)
        lowest = topk_rows(torch.where(decoded, conf, float("inf")), k, largest=False) & decoded
        out = torch.where((low.sum(-1) > k)[:, None], lowest, low)
        return self.frame(canvas, rows, st, wide, out, s.x0, conf), st

    def frame(self, canvas, rows, st: WinoState, wide_a, out_a, x0_a, conf_a) -> FrameDelta:
        """The delta of the call rows' (``rows``; None: every row) wide-in commits ``wide_a`` (tokens ``x0_a``) and
        narrow-out re-masks ``out_a`` over the step's window, with their confidences ``conf_a``."""
        g = canvas.gen_start
        s, e = g + st.window[0], g + st.window[1]
        B, W = canvas.batch_size, e - s
        if rows is None:                                   # every row took part: the call's tensors are the delta's
            commit, remask, x0, conf = wide_a, out_a, x0_a, conf_a.float()
            active = canvas.every_row()
        else:
            commit = torch.zeros((B, W), dtype=torch.bool, device=canvas.device)
            remask = torch.zeros_like(commit)
            x0 = torch.zeros((B, W), dtype=x0_a.dtype, device=canvas.device)
            conf = torch.zeros((B, W), dtype=torch.float32, device=canvas.device)
            active = torch.zeros(B, dtype=torch.bool, device=canvas.device)
            commit[rows], remask[rows], x0[rows], conf[rows], active[rows] = wide_a, out_a, x0_a, conf_a.float(), True
        tokens = torch.where(commit, x0, canvas.tokens[:, s:e])
        left = masked_after(canvas, s, commit, remask)
        if st.block_mask is None:          # a row finishes when no masked generated position is left
            finished = ~(left.any(-1) | canvas.finished)
        else:                              # the reference: only what its block mask still holds, and what follows
            lo, hi = st.block * self.block_len, (st.block + 1) * self.block_len
            now = left[:, lo:hi] & st.block_mask[:, lo:hi]
            finished = ~(now.any(-1) | left[:, hi:].any(-1)) & ~canvas.finished
        return FrameDelta(step=canvas.step + 1, nfe=1, start=s, commit=commit, tokens=tokens, active=active,
                          finished=finished, confidence=conf, remask=remask,
                          scalars={"block": st.block, "remasked": remask.sum(-1), "committed": commit.sum(-1),
                                   "window_start": s - g, "window_end": e - g})
