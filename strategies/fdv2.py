"""``fdv2``: Fast-dLLM v2's sub-block threshold decoding (``Fast_dLLM_QwenForCausalLM.generate``).

Blocks of ``block_size`` are aligned at absolute column 0. The prompt's full blocks are prefilled (one forward,
stored); when the prompt ends on a block boundary the prefill's next-token prediction (the argmax of its last
logit, at any temperature) is appended as the first token of the first block. Each block is decoded sub-block
by sub-block (``small_block_size``): while a sub-block has a mask, one decode forward of the whole block (under a
block-causal mask of block ``decode_mask_block``), the model's shifted logits of the sub-block, and a commit of
every masked position whose confidence exceeds ``threshold`` plus the most confident one. A finished block is
stored by one more forward whose last logit gives the first token of the next block (the "AR token"); the last
block gets one too, so the canvas is ``floor(P/bs)·bs + blocks·bs + 1`` columns (:func:`fdv2_gen_length`).
A block whose new positions hold the stop id with no mask before it ends the decode (it is not stored); so does
a stop id anywhere in the generation before a block opens. The returned row is cut after the first stop id
(:func:`fdv2_output`).

``use_block_cache`` (the reference's option): after a block's first full forward, a step whose sub-block starts
with a decoded token queries only that sub-block against the stored prefix and the block's keys/values from the
last full forward (stale for the other sub-blocks, as in the reference; needs ``cache=block_kv``).

Reference quirks kept by default, each with its corrected option:

* ``decode_mask_block: 32`` -- the decode forwards build their mask with the forward's default block 32 (a
  block of 64 does not see its second half while decoding); ``null`` uses ``block_size``.
* ``prompt_block_quirk: true`` -- a prompt of exactly ``block_size`` tokens is neither prefilled nor attended
  and the generated blocks' positions restart at 0; ``false`` prefills it like any longer prompt.
* ``temperature > 0`` samples from row 0 only (batch 1), top-p over the tempered softmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.strategy import CacheDirective, StepPlan, evolve
from dlm_engine.errors import ConfigError
from dlm_engine.strategies._block_diffusion import BlockDiffusionStrategy, quiet_plan, top_p_probs


@dataclass
class Fdv2Config:
    name: str = "fdv2"
    block_size: int = 32
    small_block_size: int = 8
    threshold: float = 0.9
    temperature: float = 0.0
    top_p: float = 0.95
    stop_token: Optional[int] = None       # null = the model's EOS
    use_block_cache: bool = False
    decode_mask_block: Optional[int] = 32  # quirk: the decode forwards' mask block (null = block_size)
    prompt_block_quirk: bool = True        # quirk: a prompt of exactly block_size tokens is ignored


@dataclass(frozen=True)
class Fdv2State:
    phase: str = "block"                   # prefill | block | done
    block: int = 0                         # block index from the first decoded block
    have_block_cache: bool = False         # a full forward of this block ran (its keys/values are stored)
    toks: Tuple[int, ...] = ()             # host copy of the block's columns and the next one (row 0)
    stopped: bool = False                  # a stop id occurs in the generation


def fdv2_first_block(prompt_len: int, block_size: int) -> int:
    """First column of the first decoded block."""
    return (prompt_len // block_size) * block_size


def fdv2_gen_length(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """The canvas' generation length of a ``generate`` call: ``max_new_tokens // block_size`` blocks from the
    first decoded block plus the last block's AR token."""
    return fdv2_first_block(prompt_len, block_size) + (max_new_tokens // block_size) * block_size + 1 - prompt_len


def fdv2_output(row: List[int], prompt_len: int, stop: int) -> List[int]:
    """What ``generate`` returns: the row cut after the first stop id of the generation (whole if none)."""
    gen = row[prompt_len:]
    return row[:prompt_len + gen.index(stop) + 1] if stop in gen else row


@register_strategy("fdv2", Fdv2Config)
class Fdv2(BlockDiffusionStrategy):
    def validate(self) -> None:
        c = self.cfg
        self.check_positive("block_size", c.block_size)
        self.check_positive("small_block_size", c.small_block_size)
        if c.block_size % c.small_block_size:
            raise ConfigError(f"strategy.block_size={c.block_size} is not divisible by "
                              f"strategy.small_block_size={c.small_block_size}")
        if c.decode_mask_block is not None:
            self.check_positive("decode_mask_block", c.decode_mask_block)
        self.check_non_negative("threshold", c.threshold)
        if not 0 < float(c.top_p) <= 1:
            raise ConfigError(f"strategy.top_p={c.top_p} is outside (0, 1]")
        self.n_sub = c.block_size // c.small_block_size

    # -- geometry -------------------------------------------------------------------------------------------
    def _geometry(self, canvas):
        bs, P = int(self.cfg.block_size), canvas.gen_start
        skip = self.cfg.prompt_block_quirk and P == bs      # the prompt is ignored (quirk 2)
        prefill = P > bs or (P == bs and not skip)
        return bs, P, fdv2_first_block(P, bs), prefill, skip

    def _stop(self, canvas) -> Optional[int]:
        return int(self.cfg.stop_token) if self.cfg.stop_token is not None else canvas.eos_id

    def _blocks(self, canvas) -> int:
        bs, P, S0, _, _ = self._geometry(canvas)
        return max(0, (canvas.length - S0 - 1) // bs)

    def _has_ar(self, canvas, k: int) -> bool:
        bs, P, S0, prefill, _ = self._geometry(canvas)
        return k > 0 or (prefill and P % bs == 0)

    def _positions(self, canvas):
        """Quirk 2: the generated columns' positions restart at 0 (the prompt never entered the cache)."""
        bs, _, _, _, skip = self._geometry(canvas)
        if not skip:
            return None, 0
        pos = torch.arange(canvas.length, device=canvas.device)
        pos = torch.where(pos >= bs, pos - bs, pos)
        return pos.expand(canvas.batch_size, -1), bs

    def init_state(self, canvas):
        if canvas.batch_size != 1 and self.cfg.temperature > 0:
            raise ConfigError("strategy=fdv2 samples row 0 only at temperature > 0 (the reference's IndexError "
                              "for batches): decode one row at a time")
        return Fdv2State(phase="prefill" if self._geometry(canvas)[3] else "block")

    # -- host reads -----------------------------------------------------------------------------------------
    def sync_request(self, canvas, st: Fdv2State):
        if st.phase == "done":
            return None
        bs, _, S0, _, _ = self._geometry(canvas)
        S = S0 + st.block * bs
        return canvas.tokens[0, S:min(S + bs + 1, canvas.length)]

    def synced(self, canvas, st: Fdv2State, values, delta):
        if st.phase == "done":
            return st
        toks = tuple(int(v) for v in values)
        stopped = st.stopped
        stop = self._stop(canvas)
        if st.phase == "block" and toks and self._has_ar(canvas, st.block) and toks[0] == stop \
                and not st.have_block_cache:
            stopped = True                  # the AR token opening this block is the stop id
        return evolve(st, toks=toks, stopped=stopped)

    def _settled(self, canvas, st: Fdv2State) -> bool:
        bs, P, S0, _, _ = self._geometry(canvas)
        S = S0 + st.block * bs
        start = S + 1 if self._has_ar(canvas, st.block) else max(P, S)
        new = st.toks[start - S:bs]
        stop = self._stop(canvas)
        if stop is None or stop not in new:
            return False
        return canvas.mask_id not in new[:new.index(stop)]

    # -- plans ----------------------------------------------------------------------------------------------
    def plan(self, canvas, st: Fdv2State):
        c = self.cfg
        if st.phase == "done":
            return None, st
        bs, P, S0, _, _ = self._geometry(canvas)
        pos, ks = self._positions(canvas)
        if st.phase == "prefill":
            F = S0
            window = (P, P + 1) if P % bs == 0 and P < canvas.length else (F, F)
            return quiet_plan(0, F, window, (0, F), bs), st
        if st.block >= self._blocks(canvas) or st.stopped or self._settled(canvas, st):
            return None, evolve(st, phase="done")
        S = S0 + st.block * bs
        M, sbs = canvas.mask_id, int(c.small_block_size)
        j = next((j for j in range(self.n_sub) if M in st.toks[j * sbs:(j + 1) * sbs]), None)
        if j is None:                               # the block is complete: store it, predict the next token
            end = S + bs
            window = (end, end + 1) if end < canvas.length else (end, end)
            return quiet_plan(S, end, window, (S, end), bs, key_start=ks, position_ids=pos,
                              block_start=not st.have_block_cache), st
        a, b = S + j * sbs, S + (j + 1) * sbs
        sub = c.use_block_cache and st.have_block_cache and st.toks[j * sbs] != M
        d = CacheDirective(block=(S, S + bs), block_start=not st.have_block_cache, key_start=ks,
                           query=(a, b) if sub else None,
                           attention_block=bs if sub else int(c.decode_mask_block or bs))
        return StepPlan(window=(a, b), sample=False, cache=d, position_ids=pos, info={"sub": sub}), st

    # -- steps ----------------------------------------------------------------------------------------------
    def select(self, canvas, plan, proposal, st: Fdv2State):
        d = plan.cache
        S, E = d.block
        lo, hi = plan.window
        if st.phase == "prefill" or d.store:
            commit = torch.ones((canvas.batch_size, hi - lo), dtype=torch.bool, device=canvas.device)
            tokens = proposal.logits.argmax(dim=-1) if hi > lo else commit.long()
            delta = self.delta(canvas, proposal, commit, tokens=tokens, finished=canvas.no_rows())
            if st.phase == "prefill":
                return delta, evolve(st, phase="block")
            delta.block_events = [BlockEvent("completed", st.block, S, E), BlockEvent("stored", st.block, S, E)]
            return delta, Fdv2State(phase="block", block=st.block + 1, stopped=st.stopped)
        delta = self._decode_step(canvas, proposal, lo, hi)
        if not st.have_block_cache:
            delta.block_events.insert(0, BlockEvent("opened", st.block, S, E))
        delta.scalars["block"] = st.block
        return delta, evolve(st, have_block_cache=st.have_block_cache or d.query is None)

    def _decode_step(self, canvas, proposal, lo: int, hi: int):
        c = self.cfg
        logits = proposal.logits
        cur = canvas.tokens[:, lo:hi]
        masked = cur == canvas.mask_id
        if c.temperature <= 0:
            p = torch.softmax(logits.float(), dim=-1)
            tok = p.argmax(dim=-1)
            conf = p.gather(-1, tok[..., None]).squeeze(-1)
        else:
            p = top_p_probs(torch.softmax(logits / float(c.temperature), dim=-1), float(c.top_p))
            tok = torch.multinomial(p[0], 1).view(1, -1)           # row 0 only (the reference's batch-1 sampler)
            conf = p[0].gather(-1, tok[0][:, None]).view(1, -1)
        conf = torch.where(masked, conf, torch.full_like(conf, float("-inf")))
        commit = conf > float(c.threshold)
        commit.scatter_(1, conf.argmax(dim=-1, keepdim=True), True)
        commit &= masked
        return self.delta(canvas, proposal, commit, tokens=tok, confidence=conf, finished=canvas.no_rows())
