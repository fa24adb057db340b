"""``block_buffer``: multi-block concurrent decoding (after Diffulex's MultiBD).

The generation is cut into blocks of ``block_length`` (the last may be shorter). A *buffer* of at
most ``buffer_size`` consecutive blocks, starting at the first incomplete block, is decoded by one
forward per step. In every buffered block each masked position with confidence >=
``accept_threshold`` is committed; a block where none qualifies commits its top-1 only if it is the
first of the buffer or its predecessor is semi-complete (committed fraction >=
``semi_complete_threshold``). After a step, complete blocks leave the buffer in order and, if there is
room and the newest buffered block's progress is >= ``add_block_threshold``, the next block is
admitted (one per step). State is per row and vectorised; ``buffer_size=1`` is exactly ``threshold``.
EOS options as ``threshold`` (:class:`dlm_engine.core.eos.EosOptions`); a row ended by ``stop_at_eos`` has every
block complete (its remaining blocks get ``completed`` events) and leaves the buffer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from dlm_engine.core.blockwise import block_counts, host_rows
from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.devices import host_tensor
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.eos import EosOptions, check_eos_options, eos_confidence, eos_stop, eos_suppress
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.selection import masked_conf
from dlm_engine.core.strategy import CacheDirective, Remasking, StepPlan, Strategy
from dlm_engine.errors import ConfigError


@dataclass
class BlockBufferConfig(EosOptions):
    name: str = "block_buffer"
    block_length: int = 32                 # the last block may be shorter when gen_length is not a multiple
    buffer_size: int = 4                   # blocks decoded concurrently; 1 = single-block (threshold) decoding
    accept_threshold: float = 0.9          # commit every buffered candidate with confidence >= this
    add_block_threshold: float = 0.1       # admit the next block once the newest one is this far along
    semi_complete_threshold: float = 0.9   # a block may force its top-1 once its predecessor is this far along
    temperature: float = 0.0
    remasking: Remasking = Remasking.low_confidence   # low_confidence (float64 softmax of p(x0)) | random


@dataclass(frozen=True)
class BufferState:
    first: torch.Tensor                    # [B] first block of the buffer (= first incomplete block), on device
    count: torch.Tensor                    # [B] blocks in the buffer, on device
    sizes: torch.Tensor                    # [num_blocks] positions per block (on the canvas device)
    host_first: Tuple[int, ...] = ()       # ``first`` and ``count`` as of the last host read
    host_count: Tuple[int, ...] = ()
    host_masked: Tuple[Tuple[int, ...], ...] = ()   # masked positions per row and block, as of the last host read
    events: Tuple[BlockEvent, ...] = ()    # waiting for the next delta
    window: Optional[Tuple[int, int]] = None
    step_in_window: int = 0
    stored: int = 0                        # blocks [0, stored) were handed to the cache as complete


@register_strategy("block_buffer", BlockBufferConfig)
class BlockBuffer(Strategy):
    offers = caps(Cap.BLOCKS, Cap.BLOCK_HANDOVER)
    needs = caps(Cap.BLOCK_LOGITS)

    def validate(self) -> None:
        c = self.cfg
        self.check_positive("block_length", c.block_length)
        self.check_positive("buffer_size", c.buffer_size)
        self.check_unit_interval("accept_threshold", c.accept_threshold)
        for key in ("add_block_threshold", "semi_complete_threshold"):
            if not 0.0 <= float(getattr(c, key)) <= 1.0:
                raise ConfigError(f"strategy.{key}={getattr(c, key)} is outside [0, 1]")
        self.check_non_negative("temperature", c.temperature)
        self.block_len = int(c.block_length)
        self.num_blocks = -(-self.gen_length // self.block_len)

    # -- block views -------------------------------------------------------------------------------
    def blocks(self, masked_gen: torch.Tensor) -> torch.Tensor:
        """``[B, G]`` masked flags of the generation -> ``[B, num_blocks, block_len]`` (padding counts as committed)."""
        pad = self.num_blocks * self.block_len - self.gen_length
        return F.pad(masked_gen, (0, pad)).view(-1, self.num_blocks, self.block_len)

    @staticmethod
    def progress(blocks: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        return 1.0 - blocks.sum(-1) / sizes

    def first_incomplete(self, blocks: torch.Tensor) -> torch.Tensor:
        inc = blocks.any(-1)
        none_left = torch.full_like(inc[:, 0], self.num_blocks, dtype=torch.long)
        return torch.where(inc.any(-1), inc.float().argmax(-1), none_left)

    def span(self, b: int, g: int) -> Tuple[int, int]:
        """Canvas columns of block ``b`` (the last block may be shorter)."""
        return g + b * self.block_len, g + min((b + 1) * self.block_len, self.gen_length)

    def event_list(self, kind: str, rows: List[int], blocks: List[int], batch: int, g: int) -> List[BlockEvent]:
        """Events for (row, block) pairs; one ``row=-1`` event when every row has the same one."""
        out = []
        for b in sorted(set(blocks)):
            rs = [r for r, bb in zip(rows, blocks) if bb == b]
            s, e = self.span(b, g)
            out += [BlockEvent(kind, b, s, e, -1)] if len(rs) == batch else [BlockEvent(kind, b, s, e, r) for r in rs]
        return out

    # -- policy ------------------------------------------------------------------------------------
    def init_state(self, canvas):
        check_eos_options(self.cfg, canvas)
        sizes = host_tensor([min(self.block_len, self.gen_length - b * self.block_len)
                             for b in range(self.num_blocks)], torch.long, canvas.device)
        first = self.first_incomplete(self.blocks(canvas.masked()[:, canvas.gen_start:]))
        return BufferState(first, (first < self.num_blocks).long(), sizes)

    def plan(self, canvas, st: BufferState):
        live = [(f, n) for f, n in zip(st.host_first, st.host_count) if n > 0]
        if not live:
            return None, st
        g = canvas.gen_start
        lo = min(f for f, _ in live) * self.block_len
        hi = min(max(f + n for f, n in live) * self.block_len, self.gen_length)
        window = (g + lo, g + hi)
        step_in_window = 0 if window != st.window else st.step_in_window + 1
        done_all = min(st.host_first)
        store = [self.span(b, g) for b in range(st.stored, done_all)]
        st = dataclasses.replace(st, window=window, step_in_window=step_in_window, stored=max(st.stored, done_all))
        c = self.cfg
        b0, b1 = lo // self.block_len, -(-hi // self.block_len)
        return StepPlan(
            window=window, temperature=c.temperature, masked=[sum(row[b0:b1]) for row in st.host_masked],
            confidence="random" if c.remasking == Remasking.random else "prob", softmax_dtype="float64",
            cache=CacheDirective(block=window, block_start=step_in_window == 0, step_in_block=step_in_window,
                                 store=store),
            suppress=eos_suppress(c, canvas),
        ), st

    def select(self, canvas, plan, proposal, st: BufferState):
        c, g = self.cfg, canvas.gen_start
        s, e = plan.window
        W, B = e - s, canvas.batch_size
        b0, n_win = (s - g) // self.block_len, -(-W // self.block_len)
        pad = n_win * self.block_len - W
        blk = b0 + torch.arange(n_win, device=canvas.device)                             # [n_win]
        in_buf = (blk >= st.first[:, None]) & (blk < (st.first + st.count)[:, None])     # [B, n_win]
        cand = F.pad(canvas.masked()[:, s:e], (0, pad)).view(B, n_win, self.block_len) & in_buf[..., None]
        if proposal.valid is not None:
            cand &= F.pad(proposal.valid, (0, pad)).view(B, n_win, self.block_len)
        conf_w = eos_confidence(c, canvas, plan, proposal)
        conf = F.pad(conf_w, (0, pad), value=float("-inf")).view(B, n_win, self.block_len)
        accept = cand & (conf >= c.accept_threshold)
        masked_gen = canvas.masked()[:, g:]
        prog = self.progress(self.blocks(masked_gen), st.sizes)                          # before this step
        pred_ok = torch.cat([torch.ones_like(prog[:, :1], dtype=torch.bool),
                             prog[:, :-1] >= c.semi_complete_threshold], dim=1)[:, blk]
        may_force = (blk == st.first[:, None]) | pred_ok
        need = may_force & cand.any(-1) & ~accept.any(-1)
        top = masked_conf(conf, cand).argmax(-1)
        forced = F.one_hot(top, self.block_len).bool() & need[..., None]
        commit = (accept | forced).view(B, -1)[:, :W]
        delta = eos_stop(c, canvas, self.delta(canvas, proposal, commit, confidence=conf_w))

        after = masked_gen.clone()
        after[:, s - g:e - g] &= ~commit
        if c.stop_at_eos:
            after &= ~delta.finished[:, None]          # rows ended at EOS have the rest filled
        blocks_after = self.blocks(after)
        prog_after = self.progress(blocks_after, st.sizes)
        new_first = self.first_incomplete(blocks_after)
        new_count = (st.first + st.count - new_first).clamp_min(0)
        newest = (new_first + new_count - 1).clamp(0, self.num_blocks - 1)
        room = (new_count < c.buffer_size) & (new_first + new_count < self.num_blocks)
        admit = room & ((new_count == 0) | (prog_after.gather(1, newest[:, None]).squeeze(1) >= c.add_block_threshold))
        events = list(st.events)
        for s0, e0 in (plan.cache.stored if plan.cache is not None else []):   # honoured by the cache
            events.append(BlockEvent("stored", (s0 - g) // self.block_len, s0, e0))
        count = new_count + admit.long()
        delta.block_events = events            # + completed / admitted, once the host knows (synced)
        delta.scalars.update({"committed": commit.sum(-1), "block_progress": prog_after,
                              "buffer_first": new_first, "buffer_count": count})
        return delta, dataclasses.replace(st, first=new_first, count=count, events=())

    # -- the step's host read: the buffer of every row ----------------------------------------------------
    def sync_request(self, canvas, st: BufferState):
        # + masked positions per block: only those can be committed, so the float64 softmax runs there only
        return torch.cat([st.first, st.count, block_counts(canvas, self.block_len).reshape(-1)])

    def synced(self, canvas, st: BufferState, values, delta):
        """Host copies of the buffer; the blocks that completed or were admitted become block events."""
        B, g = canvas.batch_size, canvas.gen_start
        first = tuple(int(v) for v in values[:B])
        count = tuple(int(v) for v in values[B:2 * B])
        masked = host_rows(values[2 * B:], B)
        if delta is None:                                  # before the first step: the initial buffers
            rows = [r for r in range(B) if count[r] > 0]
            events = self.event_list("admitted", rows, [first[r] for r in rows], B, g)
            return dataclasses.replace(st, host_first=first, host_count=count, host_masked=masked,
                                       events=tuple(events))
        old_first, old_end = st.host_first, [f + n for f, n in zip(st.host_first, st.host_count)]
        done = [(r, b) for r in range(B) for b in range(old_first[r], min(first[r], self.num_blocks))]
        delta.block_events += self.event_list("completed", [r for r, _ in done], [b for _, b in done], B, g)
        new = [(r, first[r] + count[r] - 1) for r in range(B) if first[r] + count[r] > max(old_end[r], first[r])]
        delta.block_events += self.event_list("admitted", [r for r, _ in new], [b for _, b in new], B, g)
        return dataclasses.replace(st, host_first=first, host_count=count, host_masked=masked)
