"""``block_buffer``: multi-block concurrent decoding (after Diffulex's MultiBD).

The generation is cut into blocks of ``block_length`` (the last may be shorter). A *buffer* of at
most ``buffer_size`` consecutive blocks, starting at the first incomplete block, is decoded by one
forward per step. In every buffered block each masked position with confidence >=
``accept_threshold`` is committed; a block where none qualifies commits its top-1 only if it is the
first of the buffer or its predecessor is semi-complete (committed fraction >=
``semi_complete_threshold``). After a step, complete blocks leave the buffer in order and, if there is
room and the newest buffered block's progress is >= ``add_block_threshold``, the next block is
admitted (one per step). ``buffer_size=1`` is exactly ``threshold``.

Each row's buffer is decided on the host from the masked positions per row and block, counted on the canvas after
every step (``reads`` / ``settle``); ``select`` works on the window with no per-row loop, gated per row and block by
two small host-made masks: the block is in the row's buffer, the block may force its top-1.
EOS options as ``threshold`` (:class:`dlm_engine.core.eos.EosOptions`); a row ended by ``stop_at_eos`` has every
block complete (its remaining blocks get ``completed`` events) and leaves the buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from dlm_engine.core.blockwise import block_counts
from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.devices import host_tensor
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.eos import EosOptions, check_eos_options, eos_confidence, eos_stop, eos_suppress
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.selection import column_indices, f32, masked_conf
from dlm_engine.core.confidence import Remasking, ranking
from dlm_engine.core.strategy import CacheDirective, StepPlan, Strategy, candidates, evolve
from dlm_engine.errors import ConfigError


@dataclass
class BlockBufferConfig(EosOptions):
    block_length: int = 32                 # the last block may be shorter when gen_length is not a multiple
    buffer_size: int = 4                   # blocks decoded concurrently; 1 = single-block (threshold) decoding
    accept_threshold: float = 0.9          # commit every buffered candidate with confidence >= this
    add_block_threshold: float = 0.1       # admit the next block once the newest one is this far along
    semi_complete_threshold: float = 0.9   # a block may force its top-1 once its predecessor is this far along
    temperature: float = 0.0
    remasking: Remasking = Remasking.low_confidence   # low_confidence (float64 softmax of p(x0)) | random


@dataclass(frozen=True)
class BufferState:
    # host arrays (numpy, never written), as of the last read: per row the buffer's first block (= the first
    # incomplete block) and its number of blocks; [B, num_blocks] masked positions per row and block
    host_first: Optional[np.ndarray] = None
    host_count: Optional[np.ndarray] = None
    host_masked: Optional[np.ndarray] = None
    host_win: Optional[Tuple[int, int]] = None  # host_window(host_first, host_count): the next step's window
    in_buf: Optional[torch.Tensor] = None  # [B, n_win] bool for the next window: the block is in the row's buffer
    may_force: Optional[torch.Tensor] = None   # ... the block may force its top-1
    events: Tuple[BlockEvent, ...] = ()    # waiting for the next delta
    window: Optional[Tuple[int, int]] = None
    step_in_window: int = 0
    stored: int = 0                        # blocks [0, stored) were handed to the cache as complete
    # per row, host arrays: the generated positions [lo, hi) of its own buffer at the last step and the steps it
    # has been decoding them (the span caches recompute for each row what it would alone: CacheDirective.row_blocks)
    row_span: Optional[np.ndarray] = None
    row_step: Optional[np.ndarray] = None


def host_progress(masked, size):
    """A block's progress ``1.0 - masked / size`` as float32 tensors compute it (integer true division in float32,
    then ``rsub``), for host numbers or numpy arrays: the same float32 operations on the host, so the same bits (a
    float32 scalar or array). Compared with a threshold rounded to float32 (:func:`f32`), as a float32 tensor
    compares with a Python scalar."""
    return np.float32(1.0) - np.asarray(masked, np.float32) / np.asarray(size, np.float32)


@register_strategy("block_buffer", BlockBufferConfig)
class BlockBuffer(Strategy):
    offers = caps(Cap.BLOCKS, Cap.BLOCK_HANDOVER)
    needs = caps(Cap.BLOCK_LOGITS)

    def validate(self) -> None:
        c = self.cfg
        self.check_positive("block_length", c.block_length)
        self.check_positive("buffer_size", c.buffer_size)
        self.check_threshold("accept_threshold", c.accept_threshold)    # a probability: (0, 1]
        for key in ("add_block_threshold", "semi_complete_threshold"):
            if not 0.0 <= float(getattr(c, key)) <= 1.0:
                raise ConfigError(f"strategy.{key}={getattr(c, key)} is outside [0, 1]")
        self.check_non_negative("temperature", c.temperature)
        self.block_len = int(c.block_length)
        self.num_blocks = -(-self.gen_length // self.block_len)
        self.sizes = tuple(min(self.block_len, self.gen_length - b * self.block_len) for b in range(self.num_blocks))
        # per block: its index, its size in float32 (host_progress) and its predecessor (block 0: itself)
        self.cols = np.arange(self.num_blocks)
        self.sizes_f32 = np.array(self.sizes, dtype=np.float32)
        self.prev = np.maximum(self.cols - 1, 0)

    # -- block views -------------------------------------------------------------------------------------------
    def span(self, b: int, g: int) -> Tuple[int, int]:
        """Canvas columns of block ``b`` (the last block may be shorter)."""
        return g + b * self.block_len, g + min((b + 1) * self.block_len, self.gen_length)

    def host_window(self, first: np.ndarray, count: np.ndarray) -> Optional[Tuple[int, int]]:
        """Generated positions ``[lo, hi)`` of the blocks buffered by any row (None = no row has a buffer)."""
        live = count > 0
        if not live.any():
            return None
        lo, hi = int(first[live].min()), int((first + count)[live].max())
        return lo * self.block_len, min(hi * self.block_len, self.gen_length)

    def event_list(self, kind: str, pairs: List[Tuple[int, int]], batch: int, g: int) -> List[BlockEvent]:
        """Events for (row, block) pairs; one ``row=-1`` event when every row has the same one."""
        out = []
        for b in sorted({bb for _, bb in pairs}):
            rs = [r for r, bb in pairs if bb == b]
            s, e = self.span(b, g)
            out += [BlockEvent(kind, b, s, e, -1)] if len(rs) == batch else [BlockEvent(kind, b, s, e, r) for r in rs]
        return out

    # -- policy ------------------------------------------------------------------------------------
    def init_state(self, canvas):
        check_eos_options(self.cfg, canvas)
        return BufferState()

    def plan(self, canvas, st: BufferState):
        w = st.host_win
        if w is None:
            return None, st
        g = canvas.gen_start
        lo, hi = w
        window = (g + lo, g + hi)
        step_in_window = 0 if window != st.window else st.step_in_window + 1
        done_all = int(st.host_first.min())
        store = [self.span(b, g) for b in range(st.stored, done_all)]
        # each row's own buffer (what its window would be alone) and the steps it has decoded it
        first, count = st.host_first, st.host_count
        row_span = np.stack([first * self.block_len, np.minimum((first + count) * self.block_len, self.gen_length)], 1)
        row_span[count == 0] = 0
        same = (np.zeros(len(first), dtype=bool) if st.row_span is None
                else (row_span == st.row_span).all(1))
        row_step = np.where(same, 0 if st.row_step is None else st.row_step + 1, 0)
        st = evolve(st, window=window, step_in_window=step_in_window, stored=max(st.stored, done_all),
                    row_span=row_span, row_step=row_step)
        c = self.cfg
        b0, b1 = lo // self.block_len, -(-hi // self.block_len)
        return StepPlan(
            window=window, temperature=c.temperature, masked=st.host_masked[:, b0:b1].sum(1).tolist(),
            confidence=ranking(c.remasking), softmax_dtype="float64",
            cache=CacheDirective(block=window, block_start=step_in_window == 0, step_in_block=step_in_window,
                                 store=store, row_blocks=row_span + g, row_block_start=row_step == 0,
                                 row_step_in_block=row_step),
            suppress=eos_suppress(c, canvas),
        ), st

    def select(self, canvas, plan, proposal, st: BufferState):
        c, g = self.cfg, canvas.gen_start
        s, e = plan.window
        W, B, bl = e - s, canvas.batch_size, self.block_len
        n_win = -(-W // bl)
        pad = n_win * bl - W
        conf_w = eos_confidence(c, canvas, plan, proposal)
        # the window as [B, n_win, block_length] (the last block padded with no candidate): candidates are the masked
        # positions of the row's buffered blocks
        cand = F.pad(candidates(canvas, proposal, e), (0, pad)).view(B, n_win, bl) & st.in_buf[..., None]
        conf = F.pad(conf_w, (0, pad), value=float("-inf")).view(B, n_win, bl)
        accept = cand & (conf >= c.accept_threshold)
        # a block with candidates but none accepted commits its top-1 where it may force one
        force = cand.any(-1) & ~accept.any(-1) & st.may_force
        top = masked_conf(conf, cand).argmax(-1)
        commit = accept | ((column_indices(bl, conf.device) == top[..., None]) & force[..., None])
        commit = commit.view(B, n_win * bl)[:, :W]
        delta = eos_stop(c, canvas, self.delta(canvas, proposal, commit, confidence=conf_w))
        events = list(st.events)
        for s0, e0 in (plan.cache.stored if plan.cache is not None else []):   # honoured by the cache
            events.append(BlockEvent("stored", (s0 - g) // bl, s0, e0))
        delta.block_events = events            # + completed / admitted, decided in settle
        # the rule's commits (an EOS stop's fill is not counted); the buffers after this step are decided in settle
        delta.scalars.update({"committed": commit.sum(-1), "block_progress": None, "buffer_first": None,
                              "buffer_count": None})
        return delta, evolve(st, events=())

    # -- what the next plan must know: masked positions per row and block --------------------------------------
    def reads(self, canvas, st: BufferState):
        return block_counts(canvas, self.block_len)

    def settle(self, canvas, st: BufferState, values, delta):
        """The buffers once the host knows the masked positions per block: complete blocks leave, and one more is
        admitted when there is room and the newest one is at least ``add_block_threshold`` along (or the buffer is
        empty); the blocks that completed or were admitted become block events. Host arrays, every row at once."""
        B, g, nb = canvas.batch_size, canvas.gen_start, self.num_blocks
        masked = np.asarray(values, dtype=np.int64).reshape(B, nb)
        progress = host_progress(masked, self.sizes_f32)               # [B, nb] float32
        first = np.where(masked > 0, self.cols, nb).min(1)             # the first incomplete block (nb: none)
        if delta is None:                                               # before the first step: the initial buffers
            count = (first < nb).astype(np.int64)
            new = np.flatnonzero(count)
            events = tuple(self.event_list("admitted", list(zip(new.tolist(), first[new].tolist())), B, g))
        else:
            old_first = st.host_first
            end = np.maximum(old_first + st.host_count, first)          # complete blocks left from the front
            count = end - first
            newest = np.clip(end - 1, 0, nb - 1)
            room = (count < self.cfg.buffer_size) & (end < nb)
            admit = room & ((count == 0) | (progress[np.arange(B), newest] >= f32(self.cfg.add_block_threshold)))
            count = count + admit                                       # an admitted block is block ``end``
            done = (self.cols >= old_first[:, None]) & (self.cols < first[:, None])   # row-major: rows, then blocks
            if done.any():
                delta.block_events += self.event_list("completed", list(zip(*(a.tolist() for a in np.nonzero(done)))), B, g)
            new = np.flatnonzero(admit)
            if new.size:
                delta.block_events += self.event_list("admitted", list(zip(new.tolist(), end[new].tolist())), B, g)
            delta.scalars["block_progress"] = host_tensor(progress, torch.float32, canvas.device)
            delta.scalars.update(zip(["buffer_first", "buffer_count"],
                                     host_tensor(np.stack([first, count]), torch.long, canvas.device).unbind(0)))
            events = st.events
        w = self.host_window(first, count)
        in_buf, may_force = self.gates(w, first, count, progress, canvas.device)
        return evolve(st, host_first=first, host_count=count, host_masked=masked, host_win=w, in_buf=in_buf,
                      may_force=may_force, events=events)

    def gates(self, w, first, count, progress, device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``[B, n_win]`` bool for the blocks of the next window ``w`` (None, None: no window): in the row's buffer;
        may force its top-1 (the buffer's first block, or its predecessor is semi-complete)."""
        if w is None:
            return None, None
        blocks = slice(w[0] // self.block_len, -(-w[1] // self.block_len))
        b = self.cols[blocks]
        in_buf = (b >= first[:, None]) & (b < (first + count)[:, None])
        may = (b == first[:, None]) | (progress[:, self.prev[blocks]] >= f32(self.cfg.semi_complete_threshold))
        return host_tensor(np.stack([in_buf, may]), torch.bool, device).unbind(0)
