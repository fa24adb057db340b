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
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.strategy import CacheDirective, StepPlan, evolve
from dlm_engine.errors import ConfigError
from dlm_engine.strategies._block_diffusion import BlockDiffusionError, BlockDiffusionStrategy, quiet_plan, top_p_probs


@dataclass
class Fdv2Config:
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
        if c.use_block_cache:       # sub-block queries against the block's stored slots
            self.needs = caps(Cap.BLOCK_LOGITS, Cap.BLOCK_KV)

    # -- geometry -------------------------------------------------------------------------------------------
    def _geometry(self, canvas):
        bs, P = int(self.cfg.block_size), canvas.gen_start
        skip = self.cfg.prompt_block_quirk and P == bs      # the prompt is ignored (quirk 2)
        prefill = P > bs or (P == bs and not skip)
        return bs, P, fdv2_first_block(P, bs), prefill, skip

    def _stop(self, canvas) -> Optional[int]:
        return int(self.cfg.stop_token) if self.cfg.stop_token is not None else canvas.eos_id

    def _blocks(self, canvas) -> int:
        """Blocks the canvas holds before its last column (the reference's last AR token); a canvas that does not
        end on that layout gets a last, shorter block."""
        bs, P, S0, _, _ = self._geometry(canvas)
        return max(0, -(-(canvas.length - S0 - 1) // bs))

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

    # -- what the next plan must know: the block's columns and the next one (row 0) ---------------------------
    def reads(self, canvas, st: Fdv2State):
        if st.phase == "done":
            return None
        bs, _, S0, _, _ = self._geometry(canvas)
        S = S0 + st.block * bs
        return canvas.tokens[0, S:min(S + bs + 1, canvas.length)]

    def settle(self, canvas, st: Fdv2State, values, delta):
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
        new = st.toks[start - S:min(S + bs, canvas.length) - S]
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
        E = min(S + bs, canvas.length)
        M, sbs = canvas.mask_id, int(c.small_block_size)
        j = next((j for j in range(self.n_sub) if M in st.toks[j * sbs:min((j + 1) * sbs, E - S)]), None)
        if j is None:                               # the block is complete: store it, predict the next token
            window = (E, E + 1) if E < canvas.length else (E, E)
            return quiet_plan(S, E, window, (S, E), bs, key_start=ks, position_ids=pos,
                              block_start=not st.have_block_cache), st
        a, b = S + j * sbs, min(S + (j + 1) * sbs, E)
        sub = c.use_block_cache and st.have_block_cache and st.toks[j * sbs] != M
        d = CacheDirective(block=(S, E), block_start=not st.have_block_cache, key_start=ks,
                           query=(a, b) if sub else None,
                           attention_block=bs if sub else int(c.decode_mask_block or bs))
        return StepPlan(window=(a, b), sample=False, cache=d, position_ids=pos), st

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
            if st.block + 1 >= self._blocks(canvas):      # the last block's store: the row is finished
                delta.finished = ~canvas.finished
            return delta, Fdv2State(phase="block", block=st.block + 1, stopped=st.stopped)
        delta = self._decode_step(canvas, proposal, lo, hi)
        if not st.have_block_cache:
            delta.block_events.insert(0, BlockEvent("opened", st.block, S, E))
        delta.scalars["block"] = st.block
        return delta, evolve(st, have_block_cache=st.have_block_cache or d.query is None)

    def _decode_step(self, canvas, proposal, lo: int, hi: int):
        commit, tok, conf = self._commit(canvas.tokens[:, lo:hi] == canvas.mask_id, proposal.logits)
        return self.delta(canvas, proposal, commit, tokens=tok, confidence=conf, finished=canvas.no_rows())

    def _commit(self, masked: torch.Tensor, logits: torch.Tensor):
        """``(commit, tokens, confidence)`` of a sub-block (``masked``: its masked positions, ``logits`` its
        shifted logits, one row per decoded row): every masked position above the threshold plus the most confident
        one."""
        c = self.cfg
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
        return commit & masked, tok, conf


# -- batch_sample: the evaluation scripts' batched form ----------------------------------------------------------
@dataclass
class Fdv2BatchConfig(Fdv2Config):
    pad_id: Optional[int] = None           # written after a finished row's stop id (null = the model's EOS)
    max_new_tokens: Optional[int] = None   # blocks = max_new_tokens // block_size + max(prompt) // block_size
                                           # (null: as many as the canvas holds)
    uncached_finish_error: bool = False    # the reference raises when every row finishes in a first block no
                                           # store followed (TypeError); false: the decode just ends there
    right_padded: bool = False             # the canvas holds rows right-padded from column 0 (batch_canvas): batch
                                           # them; false: one row at a time (the generic runners pad left)


@dataclass(frozen=True)
class Fdv2BatchState:
    phase: str = "block"                     # prefill | block | done
    block: int = 0                           # absolute block index b
    blk: Tuple[int, ...] = ()                # per row: the block its prompt reaches (the reference's blk)
    width: int = 0                           # width of the reference's X (host)
    toks: Tuple[Tuple[int, ...], ...] = ()   # per row: host copy of the block's columns
    have_block_cache: bool = False
    opened: bool = False                     # a decode step of this block ran
    finished: Tuple[bool, ...] = ()          # per row: committed the stop id in this block
    gone: Tuple[bool, ...] = ()              # per row: left the batch
    ends: Tuple[int, ...] = ()               # per row: length of its returned row (0 = still live)
    open_masked: Optional[torch.Tensor] = None   # [B, bs] masked at the block's first step (device)


def batch_canvas(prompts: List[List[int]], gen_length: int, mask_id: int, device="cpu", eos_id=None):
    """The canvas of a ``batch_sample`` call: rows right-padded with the mask id (as the evaluation scripts pad
    them) from column 0, the generation starting at the shortest prompt's end (``min_len``)."""
    from dlm_engine.core.canvas import Canvas

    W = max(len(p) for p in prompts)
    B, L = len(prompts), W + gen_length
    tokens = torch.full((B, L), mask_id, dtype=torch.long)
    step_of = torch.full((B, L), -1, dtype=torch.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.as_tensor(p, dtype=torch.long)
        step_of[i, :len(p)] = 0
    attn = torch.ones((B, L), dtype=torch.bool)
    return Canvas(tokens.to(device), step_of.to(device), attn.to(device), min(len(p) for p in prompts), mask_id,
                  eos_id=eos_id)


def batch_gen_length(seq_len: List[int], max_new_tokens: int, block_size: int) -> int:
    """Columns after the longest prompt that a ``batch_sample`` call can write (its blocks and the last AR token)."""
    last = max_new_tokens // block_size + max(seq_len) // block_size
    return last * block_size + 1 - max(seq_len)


@register_strategy("fdv2_batch", Fdv2BatchConfig)
class Fdv2Batch(Fdv2):
    """Fast-dLLM v2's ``batch_sample`` (NVlabs' ``v2/generation_functions.py``): rows of different prompt lengths,
    right-padded with the mask id, decoded block by block together; a row whose decode step commits the stop id
    is finished at the end of the block (everything after its first stop id becomes ``pad_id``, its AR token
    too) and then leaves the batch and the cache. There is no stop check inside a block. The prompt-block quirk
    applies when the shortest prompt is exactly one block; the reference's width quirk (a longer row's prompt
    token overwritten by its own AR token) and its error when every row finishes in an uncached first block are
    reproduced (the latter with ``uncached_finish_error: true``; by default such a decode just ends)."""

    unpadded_only = True        # rows start at column 0, right-padded with the mask id (batch_canvas)
    max_batch = 1               # the generic runners' left-padded batches: one row at a time (see validate)

    def validate(self) -> None:
        super().validate()
        if self.cfg.right_padded:   # a right-padded canvas (batch_canvas) is decoded as one batch
            self.max_batch = None

    def _lens(self, canvas) -> List[int]:
        return [int(n) for n in (canvas.step_of == 0).sum(-1).tolist()]

    def _geo(self, canvas):
        bs = int(self.cfg.block_size)
        seq = self._lens(canvas)
        m = min(seq)
        prefill = m > bs
        skip = self.cfg.prompt_block_quirk and not prefill and m >= bs
        if not self.cfg.prompt_block_quirk and m >= bs:
            prefill = True
        last = -(-(canvas.length - 1) // bs)      # (a canvas off the reference layout ends with a shorter block)
        if self.cfg.max_new_tokens is not None:
            last = min(last, int(self.cfg.max_new_tokens) // bs + max(seq) // bs)
        return bs, seq, m, prefill, skip, last

    def _positions(self, canvas):
        bs, seq, m, prefill, skip, last = self._geo(canvas)
        if not skip:
            return None, 0
        off = (m // bs) * bs
        pos = torch.arange(canvas.length, device=canvas.device)
        pos = torch.where(pos >= off, pos - off, pos)
        return pos.expand(canvas.batch_size, -1), off

    def init_state(self, canvas):
        if canvas.batch_size > 1 and self.cfg.temperature > 0:
            raise ConfigError("strategy=fdv2_batch samples row 0 only at temperature > 0 (the reference raises "
                              "IndexError for batches of more than one row)")
        if canvas.is_padded:
            raise ConfigError("strategy=fdv2_batch decodes rows right-padded with the mask id from column 0 "
                              "(dlm_engine.strategies.fdv2.batch_canvas), not a left-padded batch: decode one row "
                              "at a time or use strategy=fdv2")
        bs, seq, m, prefill, skip, last = self._geo(canvas)
        B = canvas.batch_size
        return Fdv2BatchState(phase="prefill" if prefill else "block", block=m // bs, blk=tuple(s // bs for s in seq),
                              width=max(seq), finished=(False,) * B, gone=(False,) * B, ends=(0,) * B)

    def _stop_pad(self, canvas):
        stop = self._stop(canvas)
        pad = self.cfg.pad_id if self.cfg.pad_id is not None else canvas.eos_id
        # no stop id known: no row ever finishes (-1 matches no token)
        return (-1 if stop is None else int(stop)), (-1 if pad is None else int(pad))

    # -- what the next plan must know: the block's columns, every row ---------------------------------------------
    def reads(self, canvas, st):
        if st.phase == "done":
            return None
        S = st.block * int(self.cfg.block_size)
        return canvas.tokens[:, S:min(S + int(self.cfg.block_size), canvas.length)]

    def settle(self, canvas, st, values, delta):
        if st.phase == "done":
            return st
        n = len(values) // canvas.batch_size
        toks = tuple(tuple(int(v) for v in values[r * n:(r + 1) * n]) for r in range(canvas.batch_size))
        return evolve(st, toks=toks)

    # -- plans ----------------------------------------------------------------------------------------------
    def plan(self, canvas, st):
        c = self.cfg
        if st.phase == "done":
            return None, st
        bs, seq, m, prefill, skip, last = self._geo(canvas)
        pos, ks = self._positions(canvas)
        live = [not g for g in st.gone]
        if st.phase == "prefill":
            F = (m // bs) * bs
            window = (F, F + 1) if m % bs == 0 else (F, F)
            return quiet_plan(0, F, window, (0, F), bs), st
        b = st.block
        if b >= last or not any(live):
            return None, evolve(st, phase="done")
        S, M, sbs = b * bs, canvas.mask_id, int(c.small_block_size)
        E = min(S + bs, canvas.length)
        rows = [r for r in range(canvas.batch_size) if live[r]]
        j = next((j for j in range(self.n_sub) if any(M in st.toks[r][j * sbs:min((j + 1) * sbs, E - S)]
                                                     for r in rows)), None)
        if j is None:
            if all(st.finished[r] for r in rows):
                if c.uncached_finish_error and ks == 0 and not prefill and b == m // bs:
                    raise BlockDiffusionError("strategy=fdv2_batch: every row finished in the first block and no "
                                              "block was stored yet (the reference raises TypeError here)")
                return None, evolve(st, phase="done")
            window = (E, E + 1) if E < canvas.length else (E, E)
            return quiet_plan(S, E, window, (S, E), bs, key_start=ks, position_ids=pos,
                              block_start=not st.opened), st
        a, b_ = S + j * sbs, min(S + (j + 1) * sbs, E)
        sub = c.use_block_cache and st.have_block_cache and all(st.toks[r][j * sbs] != M for r in rows)
        d = CacheDirective(block=(S, E), block_start=not st.opened, key_start=ks,
                           query=(a, b_) if sub else None,
                           attention_block=bs if sub else int(c.decode_mask_block or bs))
        return StepPlan(window=(a, b_), sample=False, cache=d, position_ids=pos), st

    # -- steps ----------------------------------------------------------------------------------------------
    def select(self, canvas, plan, proposal, st):
        d = plan.cache
        S, E = d.block
        bs, seq, m, prefill, skip, last = self._geo(canvas)
        B = canvas.batch_size
        rows = proposal.rows
        idx = torch.arange(B, device=canvas.device) if rows is None else rows
        stop, pad = self._stop_pad(canvas)
        if st.phase == "prefill":
            return self._prefill_step(canvas, proposal, idx, st, seq, m, bs)
        if d.store:
            return self._store_step(canvas, proposal, idx, st, seq, bs, pad, E)
        lo, hi = plan.window
        c_rows, t_rows, _ = self._commit(canvas.tokens[idx, lo:hi] == canvas.mask_id, proposal.logits)
        commit = torch.zeros((B, hi - lo), dtype=torch.bool, device=canvas.device)
        tokens = torch.zeros((B, hi - lo), dtype=torch.long, device=canvas.device)
        commit[idx], tokens[idx] = c_rows, t_rows
        open_masked = st.open_masked
        if not st.opened:
            open_masked = canvas.tokens[:, S:E] == canvas.mask_id
        # the block's tokens after this step, every row
        block = canvas.tokens[:, S:E].clone()
        block[:, lo - S:hi - S] = torch.where(commit, tokens, block[:, lo - S:hi - S])
        fin = ((block == stop) & open_masked).any(-1)
        alive = torch.tensor([not g for g in st.gone], device=canvas.device)
        done = not bool(((block == canvas.mask_id) & alive[:, None]).any())
        g0 = min(canvas.gen_start, S)
        if done:        # the block is complete: finished rows get pad after their first stop id (from their prompt end)
            cols = torch.arange(g0, E, device=canvas.device)
            row = canvas.tokens[:, g0:E].clone()
            row[:, S - g0:] = block
            seq_t = torch.tensor(seq, device=canvas.device)[:, None]
            gen = cols[None, :] >= seq_t
            is_stop = (row == stop) & gen
            first = torch.where(is_stop.any(-1), is_stop.to(torch.int8).argmax(-1) + g0, torch.full_like(seq_t[:, 0], E))
            padded = (cols[None, :] > first[:, None]) & (fin & alive)[:, None]
            new = torch.where(padded, torch.full_like(row, pad), row)
            old = canvas.tokens[:, g0:E]
            full_commit = (new != old) & alive[:, None]
            delta = self.delta(canvas, _Proposal(None, g0, proposal.active), full_commit, tokens=new, finished=canvas.no_rows())
            everyone = all(bool(f) for f, a in zip(fin.tolist(), alive.tolist()) if a)
            if everyone:                   # no store follows: the rows are finished after this step
                delta.finished = fin & alive
        else:
            delta = self.delta(canvas, _Proposal(None, lo, proposal.active), commit, tokens=tokens, finished=canvas.no_rows())
        delta.scalars["x_width"] = E
        if not st.opened:
            delta.block_events.insert(0, BlockEvent("opened", st.block, S, E))
        fin_host = tuple(bool(v) for v in fin.tolist())
        return delta, evolve(st, opened=True, have_block_cache=st.have_block_cache or d.query is None,
                             open_masked=open_masked,
                             finished=tuple(a or (bb and not g) for a, bb, g in zip(st.finished, fin_host, st.gone)))

    def _prefill_step(self, canvas, proposal, idx, st, seq, m, bs):
        B = canvas.batch_size
        F = (m // bs) * bs
        width = st.width
        if m % bs == 0:
            t = proposal.logits[:, -1].argmax(-1)
            take = torch.tensor([s == m for s in seq], device=canvas.device)
            commit = torch.zeros((B, 1), dtype=torch.bool, device=canvas.device)
            commit[idx, 0] = take[idx]
            tokens = torch.zeros((B, 1), dtype=torch.long, device=canvas.device)
            tokens[idx, 0] = t
            delta = self.delta(canvas, _Proposal(None, m, proposal.active), commit, tokens=tokens, finished=canvas.no_rows())
            if width <= m:
                width += 1
        else:
            z = torch.zeros((B, 0), dtype=torch.bool, device=canvas.device)
            delta = self.delta(canvas, _Proposal(None, F, proposal.active), z, tokens=z.long(), finished=canvas.no_rows())
        return delta, evolve(st, phase="block", width=width)

    def _store_step(self, canvas, proposal, idx, st, seq, bs, pad, E):
        B, b = canvas.batch_size, st.block
        S = b * bs
        live = [not g for g in st.gone]
        aligned = all(st.blk[r] == b for r in range(B) if live[r])
        t = proposal.logits[:, -1].argmax(-1) if proposal.logits.shape[1] else torch.zeros_like(idx)
        fin = torch.tensor(st.finished, device=canvas.device)
        tokens = torch.zeros((B, 1), dtype=torch.long, device=canvas.device)
        tokens[idx, 0] = torch.where(fin[idx], torch.full_like(t, pad), t)
        if st.width == E + 1 or aligned or st.width <= E:
            write = live
            width = E + 1
        else:
            write = [live[r] and st.blk[r] == b for r in range(B)]
            width = st.width
        write_t = torch.tensor(write, device=canvas.device)
        commit = torch.zeros((B, 1), dtype=torch.bool, device=canvas.device)
        if E < canvas.length:
            commit[:, 0] = write_t & (tokens[:, 0] != canvas.tokens[:, E])
            delta = self.delta(canvas, _Proposal(None, E, proposal.active), commit, tokens=tokens, finished=canvas.no_rows())
        else:
            z = torch.zeros((B, 0), dtype=torch.bool, device=canvas.device)
            delta = self.delta(canvas, _Proposal(None, E, proposal.active), z, tokens=z.long(), finished=canvas.no_rows())
        final = b + 1 >= self._geo(canvas)[5]          # the last block: every live row is done after its store
        leaving = tuple((bool(f) or final) and lv for f, lv in zip(st.finished, live))
        delta.finished = torch.tensor(leaving, device=canvas.device) | canvas.finished
        delta.block_events = [BlockEvent("completed", b, S, E), BlockEvent("stored", b, S, E)]
        ends = tuple(E + 1 if lv else e for e, lv in zip(st.ends, leaving))
        delta.scalars["row_ends"] = ends
        delta.scalars["x_width"] = E + 1
        blk = tuple(b + 1 if x == b else x for x in st.blk)
        return delta, Fdv2BatchState(phase="block", block=b + 1, blk=blk, width=width, finished=(False,) * B,
                                     gone=tuple(g or lv for g, lv in zip(st.gone, leaving)), ends=ends)


class _Proposal:
    """The few proposal fields :meth:`Strategy.delta` and the decode step read."""

    def __init__(self, logits, start, active=None):
        self.logits, self.start = logits, start
        self.active = active
        self.confidence = None
        self.x0 = None
