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

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.eos import EosOptions, check_eos_options, eos_confidence, eos_stop, eos_suppress
from dlm_engine.errors import ConfigError
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.selection import masked_conf
from dlm_engine.core.strategy import CacheDirective, StepPlan, Strategy


@dataclass
class BlockBufferConfig(EosOptions):
    name: str = "block_buffer"
    block_length: int = 32                 # the last block may be shorter when gen_length is not a multiple
    buffer_size: int = 4                   # blocks decoded concurrently; 1 = single-block (threshold) decoding
    accept_threshold: float = 0.9          # commit every buffered candidate with confidence >= this
    add_block_threshold: float = 0.1       # admit the next block once the newest one is this far along
    semi_complete_threshold: float = 0.9   # a block may force its top-1 once its predecessor is this far along
    temperature: float = 0.0
    remasking: str = "low_confidence"      # low_confidence (float64 softmax of p(x0)) | random


@dataclass
class BufferState:
    first: torch.Tensor                    # [B] first block of the buffer (= first incomplete block)
    count: torch.Tensor                    # [B] blocks in the buffer
    events: List[BlockEvent] = field(default_factory=list)   # waiting for the next delta
    window: Optional[Tuple[int, int]] = None
    step_in_window: int = 0
    stored: int = 0                        # blocks [0, stored) were handed to the cache as complete


@register_strategy("block_buffer", BlockBufferConfig)
class BlockBuffer(Strategy):
    caches = ("none", "prefix", "dual", "block_store")

    def validate(self) -> None:
        c = self.cfg
        self.check_positive("block_length", c.block_length)
        self.check_positive("buffer_size", c.buffer_size)
        self.check_unit_interval("accept_threshold", c.accept_threshold)
        for key in ("add_block_threshold", "semi_complete_threshold"):
            if not 0.0 <= float(getattr(c, key)) <= 1.0:
                raise ConfigError(f"strategy.{key}={getattr(c, key)} is outside [0, 1]")
        self.check_choice("remasking", c.remasking, ("low_confidence", "random"))
        self.check_non_negative("temperature", c.temperature)
        self.bl = int(c.block_length)
        self.nb = -(-self.gen_length // self.bl)
        self.sizes = torch.tensor([min(self.bl, self.gen_length - b * self.bl) for b in range(self.nb)])

    # -- block views -------------------------------------------------------------------------------
    def blocks(self, masked_gen: torch.Tensor) -> torch.Tensor:
        """``[B, G]`` masked flags of the generation -> ``[B, nb, bl]`` (padding counts as committed)."""
        return F.pad(masked_gen, (0, self.nb * self.bl - self.gen_length)).view(-1, self.nb, self.bl)

    def progress(self, blocks: torch.Tensor) -> torch.Tensor:
        return 1.0 - blocks.sum(-1) / self.sizes

    def first_incomplete(self, blocks: torch.Tensor) -> torch.Tensor:
        inc = blocks.any(-1)
        return torch.where(inc.any(-1), inc.float().argmax(-1), torch.full_like(inc[:, 0], self.nb, dtype=torch.long))

    def event_list(self, kind: str, rows: List[int], blocks: List[int], batch: int, g: int) -> List[BlockEvent]:
        """Events for (row, block) pairs; one ``row=-1`` event when every row has the same one."""
        out = []
        for b in sorted(set(blocks)):
            rs = [r for r, bb in zip(rows, blocks) if bb == b]
            s, e = g + b * self.bl, g + min((b + 1) * self.bl, self.gen_length)
            out += [BlockEvent(kind, b, s, e, -1)] if len(rs) == batch else [BlockEvent(kind, b, s, e, r) for r in rs]
        return out

    # -- policy ------------------------------------------------------------------------------------
    def init_state(self, canvas):
        check_eos_options(self.cfg, canvas)
        self.sizes = self.sizes.to(canvas.device)
        first = self.first_incomplete(self.blocks(canvas.masked()[:, canvas.gen_start:]))
        count = (first < self.nb).long()
        rows = [r for r, f in enumerate(first.tolist()) if f < self.nb]
        events = self.event_list("admitted", rows, [int(first[r]) for r in rows], canvas.batch_size, canvas.gen_start)
        return BufferState(first, count, events)

    def plan(self, canvas, st: BufferState) -> Optional[StepPlan]:
        live = st.count > 0
        if not bool(live.any()):
            return None
        g = canvas.gen_start
        lo = int((st.first * self.bl)[live].min())
        hi = min(int(((st.first + st.count) * self.bl)[live].max()), self.gen_length)
        window = (g + lo, g + hi)
        st.step_in_window = 0 if window != st.window else st.step_in_window + 1
        st.window = window
        done_all = int(st.first.min())
        store = [(g + b * self.bl, g + min((b + 1) * self.bl, self.gen_length)) for b in range(st.stored, done_all)]
        st.stored = max(st.stored, done_all)
        c = self.cfg
        return StepPlan(
            window=window, temperature=c.temperature,
            confidence="random" if c.remasking == "random" else "prob", softmax_dtype="float64",
            cache=CacheDirective(block=window, block_start=st.step_in_window == 0,
                                 step_in_block=st.step_in_window, store=store),
            suppress=eos_suppress(c, canvas),
        )

    def select(self, canvas, plan, proposal, st: BufferState):
        c, g = self.cfg, canvas.gen_start
        s, e = plan.window
        W, B = e - s, canvas.batch_size
        b0, nwb = (s - g) // self.bl, -(-W // self.bl)
        pad = nwb * self.bl - W
        blk = b0 + torch.arange(nwb, device=canvas.device)                               # [nwb]
        in_buf = (blk >= st.first[:, None]) & (blk < (st.first + st.count)[:, None])      # [B, nwb]
        cand = F.pad(canvas.masked()[:, s:e], (0, pad)).view(B, nwb, self.bl) & in_buf[..., None]
        eos_confidence(c, canvas, plan, proposal)
        conf = F.pad(proposal.confidence, (0, pad), value=float("-inf")).view(B, nwb, self.bl)
        accept = cand & (conf >= c.accept_threshold)
        masked_gen = canvas.masked()[:, g:]
        prog = self.progress(self.blocks(masked_gen))                                     # before this step
        pred_ok = torch.cat([torch.ones_like(prog[:, :1], dtype=torch.bool),
                             prog[:, :-1] >= c.semi_complete_threshold], dim=1)[:, blk]
        may_force = (blk == st.first[:, None]) | pred_ok
        need = may_force & cand.any(-1) & ~accept.any(-1)
        top = masked_conf(conf, cand).argmax(-1)
        forced = F.one_hot(top, self.bl).bool() & need[..., None]
        commit = (accept | forced).view(B, -1)[:, :W]
        delta = eos_stop(c, canvas, self.delta(canvas, proposal, commit))

        after = masked_gen.clone()
        after[:, s - g:e - g] &= ~commit
        if c.stop_at_eos:
            after &= ~delta.finished[:, None]          # rows ended at EOS have the rest filled
        blocks_after = self.blocks(after)
        prog_after = self.progress(blocks_after)
        new_first = self.first_incomplete(blocks_after)
        new_count = (st.first + st.count - new_first).clamp_min(0)
        newest = (new_first + new_count - 1).clamp(0, self.nb - 1)
        room = (new_count < c.buffer_size) & (new_first + new_count < self.nb)
        admit = room & ((new_count == 0) | (prog_after.gather(1, newest[:, None]).squeeze(1) >= c.add_block_threshold))
        events, st.events = st.events, []
        for s0, e0 in (plan.cache.stored if plan.cache is not None else []):   # honoured by the cache
            events.append(BlockEvent("stored", (s0 - g) // self.bl, s0, e0))
        if bool(((new_first != st.first) | admit).any()):
            pairs = [(r, b) for r, (f0, f1) in enumerate(zip(st.first.tolist(), new_first.tolist()))
                     for b in range(f0, min(f1, self.nb))]
            events += self.event_list("completed", [r for r, _ in pairs], [b for _, b in pairs], B, g)
            rows = admit.nonzero().squeeze(1).tolist()
            events += self.event_list("admitted", rows, (new_first + new_count)[rows].tolist(), B, g)
        st.first, st.count = new_first, new_count + admit.long()
        delta.block_events = events
        delta.scalars.update({"committed": commit.sum(-1), "block_progress": prog_after,
                              "buffer_first": st.first.clone(), "buffer_count": st.count.clone()})
        return delta, st
