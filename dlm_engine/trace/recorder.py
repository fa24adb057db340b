"""The trace recorder: a sink of the FrameDelta stream with a bounded queue and a writer thread.

The step loop only hands references to the delta's tensors to a queue (the loop never mutates a delta
after emitting it). On CUDA the hand-over also records an event; the writer thread waits on that event
and copies on a side stream, so recording adds no host-device synchronisation to the step loop. The
writer thread keeps no copy of the canvas: it logs what the deltas wrote and, at a batch's end, builds one
record per sequence from the final canvas (``step_of`` + tokens) plus what only the deltas know (the edits,
the commit confidences, the top-k logits), compresses and appends. The per-step facts (step, NFE, wall time,
active and finished rows, scalars) it reads from the batch's one :class:`~dlm_engine.core.steps.BatchSteps`, which
the batch sink fills and the run's metrics read too; the writer adds only its own columns (window start and width,
block events) and writes slices of the table as the file's step tables. A full queue blocks the producer (backpressure, never a drop).
The file is written as ``NAME.partial`` and renamed to ``NAME`` after the end record and fsync; an
interrupted or failed run leaves a flushed ``NAME.partial`` whose end record says why.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from dlm_engine.core.loop import Sink
from dlm_engine.core.steps import BatchSteps
from dlm_engine.fsutil import fsync_dir, os_error_message
from . import format as fmt
from . import records
from .format import SeqData, TraceError

STEP_CHUNK = 1024        # steps per step table (a batch's last table travels in its batch-end record)
HOLD = 128               # same-window deltas applied together by the writer (each run costs a few stacks)
HOLD_POSITIONS = 1 << 20  # ... and at most this many positions of them (B x W each): bounded memory held
FLUSH_SECONDS = 60.0     # a mid-batch steps record at least every 60 s of decoding (long batches)
FSYNC_SECONDS = 5.0      # fsync at most this often before the final one


class _Channel:
    """Bounded hand-over from the step loop to the writer thread.

    ``put`` appends to a deque (no system call) and wakes the writer only every ``wake_every`` items or
    for an urgent item; the writer also looks every ``poll`` seconds. When ``maxsize`` items wait, ``put``
    blocks until the writer catches up (backpressure: nothing is ever dropped).
    """

    def __init__(self, maxsize: int, wake_every: int = 32, poll: float = 0.1):
        self._q: deque = deque()
        self.maxsize = max(1, int(maxsize))
        self.wake_every, self.poll = max(1, int(wake_every)), float(poll)
        self.put_count = 0
        self.done_count = 0
        self._signalled = 0
        self.blocked = 0                  # times the producer had to wait (backpressure)
        self._wake = threading.Event()
        self._space = threading.Event()
        self._waiting = False
        self.error: Optional[BaseException] = None

    def put(self, item, force: bool = False, urgent: bool = False) -> None:
        if self.error is not None:
            raise TraceError(f"trace writer failed: {self.error}")
        if not force and self.put_count - self.done_count >= self.maxsize:
            self.blocked += 1
            while self.put_count - self.done_count >= self.maxsize:
                self._waiting = True
                self._space.clear()
                if self.put_count - self.done_count < self.maxsize:
                    break
                self._wake.set()
                self._space.wait(0.05)
                if self.error is not None:
                    raise TraceError(f"trace writer failed: {self.error}")
            self._waiting = False
        self._q.append(item)
        self.put_count += 1
        if urgent or self.put_count - self._signalled >= self.wake_every:
            self._signalled = self.put_count
            self._wake.set()

    def get(self):
        while True:
            try:
                return self._q.popleft()
            except IndexError:
                self._wake.wait(self.poll)
                self._wake.clear()

    def done(self) -> None:
        self.done_count += 1
        if self._waiting:
            self._space.set()


# The writer thread runs at the lowest priority (nice 19, Linux: that thread alone), so that the scheduler gives the
# model's threads a core before it: torch's intra-op threads wait for the slowest of them at every parallel region,
# and a writer burst that takes one of their cores stalls the whole forward. Measured on this project's 2-core VM
# (2 torch threads, a 384x384 matmul forward, a thread busy 0.5 ms every 10 ms, 60 alternated rounds): the forward
# +6.8% beside it at nice 0, +3.9% at nice 19. Backpressure keeps a starved writer from falling behind: a full queue
# makes the step loop wait, which frees a core for it.
WRITER_NICE = 19


def lower_priority(nice: Optional[int]) -> Optional[int]:
    """Set the calling thread's nice value (Linux, where ``setpriority`` takes a thread id; raising it needs no
    privilege); returns the thread id, or None where nothing was changed (another OS, ``nice`` None, refused)."""
    if nice is None or not sys.platform.startswith("linux"):
        return None
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, int(nice))
        return tid
    except (OSError, AttributeError, ValueError):
        return None


def _np(t) -> Any:
    """A host numpy view of a tensor (already on the host: see ``_host``)."""
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.bfloat16:      # numpy has no bfloat16
            t = t.float()
        return t.detach().numpy()
    return t


def _scalar_dtype(kinds) -> Optional[type]:
    """The dtype a step table stores a scalar of these numpy kinds in (None: not numeric, kept as JSON)."""
    if not kinds or not kinds <= {"b", "i", "u", "f"}:
        return None
    return np.bool_ if kinds == {"b"} else (np.float64 if "f" in kinds else np.int64)


def _step_names(scalars: List[Dict[str, Any]]) -> List[str]:
    """The scalar names of these steps, in the order they first appear."""
    first = tuple(scalars[0]) if scalars else ()
    if all(tuple(d) == first for d in scalars):      # (the usual case: every step the same names)
        return list(first)
    out: List[str] = []
    for d in scalars:
        for k in d:
            if k not in out:
                out.append(k)
    return out


def _plain_scalar(vals: List[Any]) -> Optional[np.ndarray]:
    """Plain Python ints / floats / bools of every step as one array, the dtype rules of the general path (None:
    not all of one such type)."""
    types = {type(v) for v in vals}
    if types == {int} and -(1 << 63) <= min(vals) and max(vals) < (1 << 63):
        return np.array(vals, dtype=np.int64)
    if types == {float}:
        return np.array(vals, dtype=np.float64)
    if types == {bool}:
        return np.array(vals, dtype=np.bool_)
    return None


class _Writes:
    """What one delta (or a run of held deltas) wrote, in the order it happened: per event its row, canvas
    column, step and kind -- a remask (the position goes back to the mask id) or a commit (of ``token``, with its
    confidence when the delta carried one). Remasks of a delta come before its commits (the canvas applies them
    first); within each, row-major."""

    __slots__ = ("row", "col", "step", "commit", "token", "conf", "has_conf")

    def __init__(self, row, col, step, commit, token, conf, has_conf):
        self.row, self.col, self.step, self.commit = row, col, step, commit
        self.token, self.conf, self.has_conf = token, conf, has_conf


def _join(chunks: List[_Writes], attr: str, dtype) -> np.ndarray:
    return (np.concatenate([getattr(c, attr) for c in chunks]).astype(dtype, copy=False) if chunks
            else np.zeros(0, dtype=dtype))


class _BatchState:
    """One batch being recorded. The writer keeps no copy of the canvas: the sequence records are the final
    canvas (the batch-end item) plus what only the deltas know -- the writes in order (for the edits, the
    positions' earlier holdings, and the check that the deltas account for the final canvas), the commit
    confidences and the top-k logits of each commit."""

    def __init__(self, batch: int, rows: List[int], tokens: np.ndarray, step_of: np.ndarray, gen_start: int,
                 mask_id: int, capture: str, topk: int, table: BatchSteps):
        self.batch, self.rows = batch, rows
        self.table = table                  # the batch's one step table (the sink appends, the writer reads)
        self.tok0 = tokens.astype(np.int64)       # the canvas the batch starts from (the given tokens)
        self.step0 = step_of.astype(np.int64)
        self.gen_start, self.mask_id = gen_start, mask_id
        self.keeps_conf = capture != "tokens"
        self.topk = topk if capture in ("topk", "logits") else 0
        self.writes: List[_Writes] = []
        self.topk_writes: List[tuple] = []  # (row, col, ids [n, k], logits [n, k]) per delta, in order
        self.finish_step = np.full(self.tok0.shape[0], -1, dtype=np.int64)
        self.wall_prev = 0                # decode time (us) after the last step written
        # the recorder's own per-step columns beside the table's (rows 0..n_steps-1 of it): the step's window
        self.start: List[int] = []
        self.width: List[int] = []
        self.events: List[tuple] = []     # (table row, BlockEvent)
        self.held: List[Any] = []         # deltas of one window not taken yet (taken together)
        self.first_pending = 0            # the first table row not yet written
        self.last_flush = 0.0             # decode wall time (s) of the last flushed step
        self.n_steps = 0                  # table rows taken (their deltas' writes logged)
        self.nfe = 0
        self.wall = 0.0

    @property
    def n_pending(self) -> int:
        return self.n_steps - self.first_pending

    def take(self, deltas: List[Any], start: int, width: int) -> None:
        """The recorder's columns of the next table rows (one per delta), and the running totals from the table."""
        a, n, T = self.n_steps, len(deltas), self.table
        if len(T) < a + n or T.step[a + n - 1] != int(deltas[-1].step):
            raise TraceError(f"trace: batch {self.batch}: step {int(deltas[-1].step)} is not row {a + n - 1} of the "
                             "batch's step table (a delta reached the writer without the sink's table)")
        self.start += [start] * n
        self.width += [width] * n
        self.events += [(a + i, e) for i, d in enumerate(deltas) for e in d.block_events]
        self.n_steps = a + n
        self.nfe += sum(T.nfe[a:a + n])
        self.wall = T.wall[a + n - 1]

    def log_remasks(self, rm: np.ndarray, s: int, t: int) -> None:
        r, c = np.nonzero(rm)
        if len(r):
            n = len(r)
            self.writes.append(_Writes(r, c + s, np.full(n, t, np.int64), np.zeros(n, np.bool_),
                                       np.full(n, self.mask_id, np.int64), np.full(n, np.nan, np.float32),
                                       np.full(n, self.keeps_conf, np.bool_)))

    def log_commits(self, commit: np.ndarray, tokens: np.ndarray, conf: Optional[np.ndarray], s: int,
                    steps) -> None:
        """``commit`` ``[B, W]`` (one delta; ``steps`` its step) or ``[n, B, W]`` (a run of ``n`` deltas; ``steps``
        theirs), ``tokens`` and ``conf`` (None: not carried) of the same shape."""
        where = np.nonzero(commit)
        n = len(where[0])
        if not n:
            return
        k = where[0] if commit.ndim == 3 else None
        r, c = where[-2], where[-1]
        step = np.asarray(steps, dtype=np.int64)[k] if k is not None else np.full(n, int(steps), np.int64)
        has = conf is not None and self.keeps_conf
        self.writes.append(_Writes(r, c + s, step, np.ones(n, np.bool_), tokens[where].astype(np.int64),
                                   conf[where].astype(np.float32) if has else np.full(n, np.nan, np.float32),
                                   np.full(n, has, np.bool_)))

    def replay(self, tokens: np.ndarray, step_of: np.ndarray):
        """From the writes: the confidence of every position (its last commit's; NaN when never committed or
        re-masked after it), the edits of every row (the holdings a remask or an overwrite ended, in the order
        they ended: ``(row, col, token, start, end, confidence)``), and whether the writes account for the final
        canvas ``tokens`` / ``step_of`` in the generation region (False: something changed the canvas outside the
        deltas)."""
        w = self.writes
        row, col, step = _join(w, "row", np.int64), _join(w, "col", np.int64), _join(w, "step", np.int64)
        com, tok = _join(w, "commit", np.bool_), _join(w, "token", np.int64)
        conf, has = _join(w, "conf", np.float32), _join(w, "has_conf", np.bool_)
        B, L = self.tok0.shape
        n = len(row)
        order = np.lexsort((np.arange(n), col, row))          # each position's writes together, in order
        row, col, step, com, tok, conf, has = (x[order] for x in (row, col, step, com, tok, conf, has))
        idx = np.arange(n)
        first = np.ones(n, np.bool_)
        first[1:] = (row[1:] != row[:-1]) | (col[1:] != col[:-1])
        last = np.ones(n, np.bool_)
        last[:-1] = first[1:]
        chain = np.maximum.accumulate(np.where(first, idx, 0)) if n else idx
        prev = np.maximum(idx - 1, 0)
        # what each write found: the holding the previous write (or the batch's start) left
        held = np.where(first, self.step0[row, col] >= 0, com[prev]) if n else np.zeros(0, np.bool_)
        held_tok = np.where(first, self.tok0[row, col], tok[prev]) if n else tok
        held_start = np.where(first, self.step0[row, col], step[prev]) if n else step
        # the confidence it held: the last write before it that set one (a remask sets NaN)
        setter = np.maximum.accumulate(np.where(has, idx, -1)) if n else idx
        before = np.concatenate([[-1], setter[:-1]]) if n else setter
        held_conf = np.where(before >= chain, conf[np.maximum(before, 0)], np.float32(np.nan)).astype(np.float32)
        e = np.nonzero(held)[0]
        e = e[np.argsort(order[e], kind="stable")]            # the order the holdings ended in
        edits = (row[e], col[e], held_tok[e], held_start[e], step[e], held_conf[e])
        final_conf = None
        if self.keeps_conf:
            final_conf = np.full((B, L), np.nan, dtype=np.float32)
            at = last & (setter >= chain)
            final_conf[row[at], col[at]] = conf[setter[at]]
        rt, rs = self.tok0.copy(), self.step0.copy()           # the writes' account of the final canvas
        rt[row[last], col[last]] = tok[last]
        rs[row[last], col[last]] = np.where(com[last], step[last], -1)
        P = self.gen_start
        accounted = np.array_equal(tokens[:, P:], rt[:, P:]) and np.array_equal(step_of[:, P:], rs[:, P:])
        return final_conf, edits, accounted

    def final_topk(self):
        """``(ids [B, L, k], logits [B, L, k])`` of every position's last commit with top-k logits (-1 / NaN
        where none)."""
        B, L = self.tok0.shape
        ids = np.full((B, L, self.topk), -1, dtype=np.int64)
        vals = np.full((B, L, self.topk), np.nan, dtype=np.float32)
        for r, c, i, v in self.topk_writes:      # in order: a later commit of a position replaces an earlier one
            k = i.shape[1]
            ids[r, c, :k] = i
            vals[r, c, :k] = v
        return ids, vals


class TraceRecorder:
    """Records every batch of a run into one trace file.

    ``sink(batch, rows)`` returns the :class:`Sink` for one batch (``rows``: the global row indices of
    its prompts, in ``results.jsonl`` order). Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str, header: Dict[str, Any], capture: str = "tokens", topk: int = 5,
                 logit_error_bound: float = 1e-2, queue_size: int = 256, level: int = fmt.ZSTD_LEVEL,
                 recomputed: bool = False, threaded: bool = True, writer_nice: Optional[int] = WRITER_NICE):
        """``threaded=False``: no writer thread -- each sink call does the writer's work before it returns (the
        same records; an error surfaces at the call that caused it). For profiling the writer's own work, which
        ``writer_cpu`` then sums, and for debugging; a decode should keep the thread.
        ``writer_nice``: the writer thread's nice value on Linux (that thread alone; None: the process'), see
        ``WRITER_NICE``."""
        from ..errors import ConfigError

        if capture not in fmt.CAPTURE_LEVELS:
            raise ConfigError(f"trace.capture={capture} is not one of {', '.join(fmt.CAPTURE_LEVELS)}")
        if capture in ("topk", "logits") and int(topk) <= 0:
            raise ConfigError(f"trace.topk={topk} must be a positive integer")
        if not (float(logit_error_bound) > 0):
            raise ConfigError(f"trace.logit_error_bound={logit_error_bound} must be > 0")
        if int(queue_size) <= 0:
            raise ConfigError(f"trace.queue_size={queue_size} must be a positive integer")
        self.path = str(path)
        self.partial_path = self.path + ".partial"
        self.capture, self.topk, self.bound, self.level = capture, int(topk), float(logit_error_bound), int(level)
        self.wants_logits = capture in ("topk", "logits")
        self.recomputed = bool(recomputed)   # per-step scalar `recomputed`: [B, L] columns the cache recomputed
        self.digest: Optional[str] = None
        self.writer_cpu = 0.0
        self.status: Optional[str] = None
        self.records = {k: 0 for k in fmt.KIND_NAMES}
        self.bytes_written = 0
        self._hash = hashlib.sha256()
        self._chan = _Channel(queue_size)
        self._batches: Dict[int, _BatchState] = {}
        self._side_stream = None
        # CUDA events the writer has waited on, kept for the sinks to record again: a fresh event costs the step
        # loop a create (and the writer a destroy) on top of its record (per device: an event records on one)
        self._spare_events: Dict[int, List] = {}
        self._last_fsync = time.perf_counter()
        header = dict(header)
        header.setdefault("format", "dlm_engine trace")
        header["capture"] = {"level": capture, "topk": self.topk if self.wants_logits else None,
                             "logit_error_bound": self.bound if capture == "logits" else None,
                             "recomputed": self.recomputed}
        self.header = header
        header_json = json.dumps(header, sort_keys=True, default=str).encode()
        from .reader import check_header

        # the limits a reader will apply to this file: batches that exceed them are refused while writing
        written = json.loads(header_json)        # the header as a reader will see it
        self.limits = check_header(written)
        self._batch_defaults = records.batch_defaults(written)
        self._f = _open_exclusive(self.partial_path)
        self._ino = os.fstat(self._f.fileno()).st_ino
        try:
            self._write_raw(fmt.PREAMBLE)
            # (level 3: 0.05 ms instead of 0.3 at level 9 for ~140 more bytes of a ~4 KB header)
            self._write(fmt.HEADER, fmt.zc(header_json, fmt.HEADER_ZSTD_LEVEL))
            self._f.flush()
        except OSError as exc:
            try:
                self._f.close()   # (flushing what is buffered may fail the same way)
            except OSError:
                pass
            raise TraceError(_os_message(self.partial_path, exc)) from None
        self._thread: Optional[threading.Thread] = None
        self.writer_nice = writer_nice
        self.writer_tid: Optional[int] = None       # the writer thread's id in the kernel, once it runs (Linux)
        if threaded:
            self._thread = threading.Thread(target=self._run, name="dlm-trace-writer", daemon=True)
            self._thread.start()
        self._closed = False

    # -- producer side (the step loop's thread) ------------------------------------------------------
    def sink(self, batch: int, rows: Sequence[int], table: Optional[BatchSteps] = None) -> "BatchSink":
        """The batch's sink; ``table``: the batch's step table when the caller keeps one already (the sink then
        fills it: no sink of the batch may append to it besides)."""
        return BatchSink(self, int(batch), [int(r) for r in rows], table)

    def _put(self, item, urgent: bool = False) -> None:
        if self._closed:
            raise TraceError("trace recorder is closed")
        if self._thread is None:
            self._inline(self._handle, item)
            return
        self._chan.put(item, urgent=urgent)

    def _inline(self, fn, arg) -> None:
        """The writer's work on the caller's thread (``threaded=False``), its CPU added to ``writer_cpu``."""
        chan = self._chan
        if chan.error is not None:
            raise TraceError(f"trace writer failed: {chan.error}")
        c = time.thread_time()
        try:
            fn(arg)
        except BaseException as exc:
            chan.error = TraceError(_os_message(self.partial_path, exc)) if isinstance(exc, OSError) else exc
            raise TraceError(f"trace writer failed: {chan.error}") from None
        finally:
            self.writer_cpu += time.thread_time() - c

    @property
    def blocked_puts(self) -> int:
        return self._chan.blocked

    def close(self, status: str = "complete") -> Optional[str]:
        """Drain the queue, write the end record, fsync; rename to the final name when complete.

        Returns the sha256 digest of the file. Safe to call twice.
        """
        if self._closed:
            return self.digest
        self._closed = True
        if self._thread is None:
            if self._chan.error is None:
                try:
                    self._inline(self._finish, status)
                except TraceError:
                    pass                 # (reported below, as the threaded writer's failure is)
        else:
            self._chan.put(("close", status), force=True, urgent=True)
            self._thread.join()
        if self._chan.error is not None:
            try:
                self._f.close()
            except OSError:
                pass
            raise TraceError(f"trace writer failed: {self._chan.error}")
        self.status = status
        if status == "complete":
            try:
                if os.stat(self.partial_path).st_ino != self._ino:
                    raise TraceError(f"{self.partial_path} was replaced by another process while this run wrote it")
                os.replace(self.partial_path, self.path)
            except OSError as exc:
                raise TraceError(_os_message(self.partial_path, exc)) from None
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        return self.digest

    @property
    def written_path(self) -> str:
        return self.path if self.status == "complete" else self.partial_path

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, et, ev, tb) -> None:
        if et is None:
            self.close("complete")
        else:
            status = "interrupted" if issubclass(et, KeyboardInterrupt) else f"failed: {et.__name__}: {ev}"
            try:
                self.close(status)
            except TraceError:
                pass

    # -- writer thread ---------------------------------------------------------------------------------
    def _write_raw(self, b: bytes) -> None:
        self._f.write(b)
        self._hash.update(b)
        self.bytes_written += len(b)

    def _write(self, kind: int, payload: bytes) -> None:
        self._write_raw(fmt.frame_record(kind, payload))
        self.records[kind] += 1

    def _run(self) -> None:
        chan = self._chan
        self.writer_tid = lower_priority(self.writer_nice)
        while True:
            item = chan.get()
            is_close = item[0] == "close"
            try:
                if chan.error is None:
                    if is_close:
                        self._finish(item[1])
                    else:
                        self._handle(item)
            except BaseException as exc:  # never die silently: the producer sees it on its next put
                chan.error = TraceError(_os_message(self.partial_path, exc)) if isinstance(exc, OSError) else exc
            chan.done()
            if is_close:
                self.writer_cpu = time.thread_time()   # CPU seconds the writer thread used (benchmarks)
                return

    def _host(self, t):
        # (the tensor's own device, not only ``_cuda``: items may reach a recorder without a sink's ``on_start``,
        # e.g. a writer replay of captured items; ``is_cuda`` is an attribute read)
        if isinstance(t, torch.Tensor) and t.is_cuda:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=t.device)
            with torch.cuda.stream(self._side_stream):
                return t.to("cpu")
        return t

    def _stack(self, tensors) -> np.ndarray:
        """One host array from same-shaped tensors (one stack + one copy instead of one per step)."""
        if tensors[0].is_cuda:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=tensors[0].device)
            with torch.cuda.stream(self._side_stream):
                return _np(torch.stack(tensors).to("cpu"))
        return _np(torch.stack(tensors))

    def _waited(self, event) -> None:
        """Wait for a sink's event (the step's work is done on the device), then keep it for reuse."""
        if event is not None:
            event.synchronize()
            self._spare_events.setdefault(event.device.index, []).append(event)   # (append: atomic under the GIL)

    def _handle(self, item) -> None:
        kind = item[0]
        if kind == "delta":
            _, batch, delta, event = item
            self._waited(event)
            st = self._batches[batch]
            if self.wants_logits or delta.remask is not None:
                self._flush_held(st)
                self._on_delta(st, delta)
                return
            if st.held and (st.held[0].start != delta.start or st.held[0].commit.shape != delta.commit.shape):
                self._flush_held(st)
            st.held.append(delta)
            if len(st.held) >= min(HOLD, max(1, HOLD_POSITIONS // max(1, delta.commit.numel()))):
                self._flush_held(st)
        elif kind == "begin":
            self._on_begin(*item[1:])
        elif kind == "end":
            self._flush_held(self._batches[item[1]])
            self._on_end(*item[1:])

    def _flush_held(self, st: _BatchState) -> None:
        """Take a run of same-window deltas at once (vectorised: one stack per field)."""
        ds, st.held = st.held, []
        if len(ds) <= 1:
            for d in ds:
                self._on_delta(st, d)
            return
        s = int(ds[0].start)
        C = self._stack([d.commit for d in ds])                      # [n, B, W]
        W = C.shape[2]
        steps = np.array([int(d.step) for d in ds], dtype=np.int64)
        conf = None
        if st.keeps_conf:
            confs = [d.confidence for d in ds]
            if all(c is not None and c.dtype == confs[0].dtype and c.shape == confs[0].shape for c in confs):
                conf = self._stack(confs)                           # stacked on the copy stream
        if conf is not None or not st.keeps_conf:
            st.log_commits(C, self._stack([d.tokens for d in ds]), conf, s, steps)
        else:                                                       # confidences of differing kinds: per delta
            for i, d in enumerate(ds):
                c = d.confidence
                st.log_commits(C[i], _np(self._host(d.tokens)), None if c is None else _np(self._host(c)), s,
                               steps[i])
        st.take(ds, s, W)        # (finished, active, scalars: the step table's, read when the steps are written)
        self._flush_full(st)

    def _on_begin(self, batch, rows, tokens, step_of, attn, gen_start, mask_id, info, rng, table, event) -> None:
        self._waited(event)
        tokens, step_of, attn = (_np(self._host(t)) for t in (tokens, step_of, attn))
        self._check_shape(batch, tokens.shape[0], gen_start, tokens.shape[1])
        st = _BatchState(batch, rows, tokens, step_of, gen_start, mask_id, self.capture, self.topk, table)
        self._batches[batch] = st
        P = gen_start
        meta = {"batch": batch, "rows": rows, "gen_start": P, "length": int(tokens.shape[1]), "mask_id": mask_id,
                "info": {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v)) for k, v in info.items()}}
        # tokens given inside the generation region (constraints) are part of the sequence records
        fp = None if rng is None else records.rng_fingerprint(b"".join(t.numpy().tobytes() for t in rng))
        self._write(fmt.BATCH, records.encode_batch(meta, tokens[:, :P], attn[:, :P], fp, self._batch_defaults,
                                                    self.level))

    def _check_shape(self, batch: int, B: int, P: int, L: int) -> None:
        """A batch the header's shape facts do not allow would make the file unreadable: refuse it now."""
        lim = self.limits
        for what, v, hi in (("rows", B, lim.batch), ("prompt positions", P, lim.prompt),
                            ("generated positions", L - P, lim.gen), ("positions", B * L, lim.positions)):
            if v > hi:
                raise TraceError(f"trace: batch {batch} has {v} {what}, the trace header allows {hi} "
                                 "(header 'shape' section)")

    def _on_delta(self, st: _BatchState, delta) -> None:
        s = int(delta.start)
        commit = _np(self._host(delta.commit))
        W = commit.shape[1]
        t = int(delta.step)
        if delta.remask is not None:
            st.log_remasks(_np(self._host(delta.remask)), s, t)
        conf = None
        if st.keeps_conf and delta.confidence is not None:
            conf = _np(self._host(delta.confidence))
        st.log_commits(commit, _np(self._host(delta.tokens)), conf, s, t)
        logits = getattr(delta, "logits", None)
        if logits is not None and st.topk:
            self._capture_logits(st, delta, logits, commit, s, W)
        st.take([delta], s, W)
        self._flush_full(st)

    def _capture_logits(self, st: _BatchState, delta, logits, commit, s: int, W: int) -> None:
        lg = self._host(logits)
        if lg.dtype not in (torch.float32, torch.float64):
            lg = lg.float()
        r, c = np.nonzero(commit)
        if len(r):
            sel = lg[torch.from_numpy(r), torch.from_numpy(c)]
            k = min(self.topk, sel.shape[-1])
            vals, ids = torch.topk(sel.float(), k, dim=-1)
            st.topk_writes.append((r, s + c, ids.numpy().astype(np.int64), vals.numpy()))
        if self.capture == "logits":
            meta, arrays = fmt.quantize_logits(lg.float().numpy(), self.bound)
            meta.update(batch=st.batch, step=int(delta.step), start=s)
            self._write(fmt.LOGITS, fmt.encode_bundle(meta, arrays, level=3))

    def _flush_full(self, st: _BatchState) -> None:
        """Steps records of ``STEP_CHUNK`` steps while that many wait, and of what waits every ``FLUSH_SECONDS``
        of decoding; the rest goes with the batch-end record."""
        while st.n_pending >= STEP_CHUNK:
            self._flush_steps(st, limit=STEP_CHUNK)
        if st.n_pending and st.wall - st.last_flush >= FLUSH_SECONDS:
            self._flush_steps(st)

    def _flush_steps(self, st: _BatchState, final: bool = False, limit: Optional[int] = None) -> Optional[bytes]:
        """Write the pending steps (the first ``limit``) as a steps record, or (``final``) return their table for
        the batch-end record: rows of the batch's step table (read here, host copies made for the record) beside
        the recorder's own columns."""
        if not st.n_pending:
            return None
        n = st.n_pending if limit is None else min(limit, st.n_pending)
        a, b, T = st.first_pending, st.first_pending + n, st.table
        steps = np.array(T.step[a:b], dtype=np.int64)
        F = self._stack(T.finished[a:b])
        newly = F.any(0) & (st.finish_step < 0)
        if newly.any():
            st.finish_step[newly] = steps[F.argmax(0)][newly]
        arrays = {
            # wall time (seconds since decode start) in microseconds; quantised by records.encode_table
            "wall_us": np.rint(np.array(T.wall[a:b], dtype=np.float64) * 1e6).astype(np.int64),
            "step": steps,
            "nfe": np.array(T.nfe[a:b], dtype=np.int32),
            "start": np.array(st.start[a:b], dtype=np.int32),
            "width": np.array(st.width[a:b], dtype=np.int32),
            "active": self._stack(T.active[a:b]).astype(np.bool_),
            "finished": F.astype(np.bool_),
        }
        json_scalars = {}
        scal = T.scalars[a:b]
        for k in _step_names(scal):
            vals = [d.get(k) for d in scal]
            arr = self._uniform_scalar(vals)
            if arr is not None:
                arrays["s:" + k] = arr
                continue
            # (copies: a strategy might reuse a state tensor as a scalar)
            vals = [_np(self._host(v)).copy() if isinstance(v, torch.Tensor) else v for v in vals]
            present = np.array([v is not None for v in vals])
            got = [np.asarray(v) for v in vals if v is not None]
            shapes = {g.shape for g in got}
            dt = _scalar_dtype({g.dtype.kind for g in got})
            if len(shapes) == 1 and dt is not None:
                arr = np.zeros((n,) + next(iter(shapes)), dtype=dt)
                arr[present] = np.stack(got).astype(dt)
                arrays["s:" + k] = arr
                if not present.all():
                    arrays["p:" + k] = present
            else:
                json_scalars[k] = [None if v is None else (np.asarray(v).tolist()) for v in vals]
        events = [[i - a, e.kind, int(e.block), int(e.start), int(e.end), int(e.row)] for i, e in st.events if i < b]
        st.events = [x for x in st.events if x[0] >= b] if events else st.events
        meta = {"first": st.first_pending, "events": events, "json_scalars": json_scalars}
        table = records.encode_table(meta, arrays, st.wall_prev, self.level)
        st.wall_prev = max(st.wall_prev, int(arrays["wall_us"].max()))
        st.first_pending += n
        st.last_flush = st.wall
        if final:
            return table
        head = bytearray()
        fmt.put_varint(head, st.batch)
        self._write(fmt.STEPS, bytes(head) + table)
        self._f.flush()              # a mid-batch table reaches the OS now, not at the batch's end
        return None

    def _uniform_scalar(self, vals: List[Any]) -> Optional[np.ndarray]:
        """A scalar every step has as one array where that takes no per-step work: same-shaped numeric tensors (one
        stack), or plain Python ints / floats / bools (the general path's dtype rules); None otherwise."""
        if any(v is None for v in vals):
            return None
        v0 = vals[0]
        if isinstance(v0, torch.Tensor):
            if not all(isinstance(x, torch.Tensor) and x.shape == v0.shape and x.dtype == v0.dtype for x in vals):
                return None
            arr = self._stack(vals)
            dt = _scalar_dtype({arr.dtype.kind})
            return None if dt is None else arr.astype(dt)
        return _plain_scalar(vals)

    def _on_end(self, batch, tokens, step_of, row_nfe, event) -> None:
        self._waited(event)
        st = self._batches.pop(batch)
        table = self._flush_steps(st, final=True)
        tokens, step_of, row_nfe = (_np(self._host(t)) for t in (tokens, step_of, row_nfe))
        P = st.gen_start
        final_tok, final_step = tokens.astype(np.int64), step_of.astype(np.int64)
        if final_tok.size and int(final_tok.max()) >= self.limits.vocab:
            raise TraceError(f"trace: batch {batch} holds token id {int(final_tok.max())}, the header's vocabulary "
                             f"has {self.limits.vocab}")
        final_conf, edits, accounted = st.replay(final_tok, final_step)
        mismatch = not accounted
        topk_ids, topk_logits = st.final_topk() if st.topk else (None, None)
        e_row = edits[0]
        seqs = []
        for i, row in enumerate(st.rows):
            so = final_step[i, P:]
            sd = SeqData(row=row, tokens=final_tok[i, P:], step_of=so, nfe=int(row_nfe[i]),
                         finish_step=int(st.finish_step[i]))
            if final_conf is not None:
                sd.confidence = final_conf[i, P:]
            mine = e_row == i
            if mine.any():
                sd.edits = {"col": edits[1][mine], "token": edits[2][mine], "start": edits[3][mine],
                            "end": edits[4][mine], "confidence": edits[5][mine].astype(np.float32)}
            if topk_ids is not None:
                committed = so >= 1
                sd.topk_ids = np.maximum(topk_ids[i, P:][committed], 0)
                sd.topk_logits = topk_logits[i, P:][committed]
            seqs.append(sd)
        for payload in fmt.encode_seqs(seqs, self.level):      # (the batch's records sized together)
            self._write(fmt.SEQ, payload)
        self._write(fmt.BATCH_END, records.encode_batch_end(
            {"batch": batch, "steps": st.n_steps, "nfe": st.nfe, "wall_time": st.wall, "mismatch": bool(mismatch),
             "rows": st.rows}, table, self.level))
        self._f.flush()
        if time.perf_counter() - self._last_fsync >= FSYNC_SECONDS:
            os.fsync(self._f.fileno())
            self._last_fsync = time.perf_counter()

    def _finish(self, status: str) -> None:
        for st in list(self._batches.values()):   # batches cut short: keep their step records
            self._flush_held(st)
            self._flush_steps(st)
        unfinished = sorted(self._batches)
        meta = {"status": status, "records": {fmt.KIND_NAMES[k]: v for k, v in self.records.items()},
                "unfinished_batches": unfinished, "sha256_before_end": self._hash.hexdigest(),
                "bytes_before_end": self.bytes_written, "queue": {"size": self._chan.maxsize, "blocked_puts": self._chan.blocked},
                "finished_after": max(0, int(time.time()) - records.time_origin(self.header))}
        self._write(fmt.END, records.encode_end(meta, {v: k for k, v in fmt.KIND_NAMES.items()}))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self.digest = "sha256:" + self._hash.hexdigest()


def _os_message(path: str, exc: BaseException) -> str:
    """``PATH: No space left on device``: one line naming the file and the errno text."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return os_error_message(exc)
    return f"{path}: {getattr(exc, 'strerror', None) or exc}"


def _open_exclusive(path: str):
    """Open ``path`` for writing, held by this process alone: a second writer of the same trace fails at
    once (``flock``; released when the file is closed or the process dies) instead of interleaving records."""
    import fcntl

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    except OSError as exc:
        raise TraceError(_os_message(path, exc)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise TraceError(f"{path}: another process is writing this trace") from None
    os.ftruncate(fd, 0)
    return os.fdopen(fd, "wb")


class BatchSink(Sink):
    """The sink of one batch; hands tensors over without copying or synchronising. It owns the batch's
    :class:`~dlm_engine.core.steps.BatchSteps` (``step_table``; given, or a new one): each delta's row goes into it
    before the delta goes to the writer, which writes the step records from it; the run's metrics read the same
    table (:func:`dlm_engine.core.steps.batch_steps`)."""

    def __init__(self, rec: TraceRecorder, batch: int, rows: List[int], table: Optional[BatchSteps] = None):
        self.rec, self.batch, self.rows = rec, batch, rows
        self.step_table = table if table is not None else BatchSteps()
        self.wants_logits = rec.wants_logits
        self.wants_recomputed = rec.recomputed
        self._cuda = False
        self._stream = self._spare = None

    def _event(self):
        """A CUDA event recorded on the decode's stream after the step's work (None on other devices): the writer
        waits on it, not the step loop. A spare one from the recorder's pool when there is one (``list.pop`` is
        atomic under the GIL; the writer returns each event after its wait), recorded on the stream taken at
        ``on_start`` (``torch.cuda.current_stream`` builds a Python object a call)."""
        if not self._cuda:
            return None
        try:
            ev = self._spare.pop()
        except IndexError:
            ev = torch.cuda.Event()
        ev.record(self._stream)
        return ev

    def on_start(self, canvas, info: dict) -> None:
        self._cuda = canvas.device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.current_stream(canvas.device)
            self._spare = self.rec._spare_events.setdefault(self._stream.device.index, [])
        if len(self.rows) != canvas.batch_size:
            raise TraceError(f"batch {self.batch}: {len(self.rows)} row indices for a batch of {canvas.batch_size}")
        # generator states as tensors (host copies, no device sync); the writer thread turns them into bytes
        rng = [torch.random.get_rng_state()]
        if self._cuda:
            rng.append(torch.cuda.get_rng_state(canvas.device))
        self.rec._put(("begin", self.batch, self.rows, canvas.tokens.clone(), canvas.step_of.clone(),
                       canvas.attention_mask.clone(), canvas.gen_start, canvas.mask_id, dict(info), rng, self.step_table,
                       self._event()))

    def on_delta(self, delta, canvas) -> None:
        self.step_table.append(delta)
        self.rec._put(("delta", self.batch, delta, self._event()))

    def on_end(self, canvas) -> None:
        self.rec._put(("end", self.batch, canvas.tokens.clone(), canvas.step_of.clone(), canvas.row_nfe.clone(),
                       self._event()), urgent=True)
