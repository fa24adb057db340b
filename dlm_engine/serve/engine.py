"""The decode worker of ``dlm-serve``: a bounded queue of requests and one thread that decodes them in batches.

Requests that arrive while a batch decodes wait for the next one. The worker takes the oldest waiting request,
waits up to ``max_batch_wait`` seconds for more requests with the same settings (:func:`~.config.batch_key`) up
to the batch limit (:func:`~.config.batch_limit`), and decodes them together through the Python API
(:func:`dlm_engine.app.api.decode_batch`, the same per-sequence metrics as ``dlm``). At temperature 0 each row
of a batch follows the trajectory it follows alone (tests/test_batch_invariance.py), so an answer does not
depend on what it was batched with.

Each step, a :class:`ServeSink` hands the rows that stream their text or steps their events, and frees the
rows of requests that were cancelled (client gone, timed out): they are marked finished, so the step loop
leaves them out of the forwards from the next step on; a batch whose every request is cancelled stops.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from dlm_engine.core.loop import Sink

log = logging.getLogger("dlm_engine.serve")

# strategies whose committed tokens never change (no re-mask, no edit): their text streams as the committed
# left-to-right prefix grows. Others (re-masking, editing) stream their text once, when the sequence is done.
PREFIX_STABLE = frozenset({"low_confidence", "threshold", "factor", "block_buffer", "klass", "ar", "cadllm",
                           "certainty_prior", "pc_sampler", "eb_sampler", "early_exit"})


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the request queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


class Cancelled(Exception):
    pass


class _BatchCancelled(Exception):
    """Raised by the sink when every request of a batch was cancelled: the decode stops there."""


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class Request:
    """One prompt to decode. ``emit(kind, payload)`` is called from the worker thread (``kind``: ``"text"``,
    ``"step"``, ``"done"``, ``"error"``); the HTTP side turns it into its own events."""

    id: str
    cfg: Any                          # the validated run config of its settings
    key: str                          # batch key
    prompt_ids: List[int]
    emit: Callable[[str, Any], None]
    stream_text: bool = False
    stream_steps: bool = False
    prompt: Optional[str] = None
    arrived: float = field(default_factory=time.perf_counter)
    started: Optional[float] = None   # when its batch's decode started
    cancelled: bool = False
    # per-stream state (worker thread only)
    sent_text: str = ""
    sent_tokens: int = 0
    prev_tokens: Optional[np.ndarray] = None
    own_steps: List[int] = field(default_factory=list)   # the batch steps this request took part in


    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Outcome:
    """What a finished request gets (besides its events)."""

    row: Any                          # dlm_engine.app.api.RowResult
    batch_size: int
    queue_wait: float
    decode_time: float
    trace: Optional[str]
    cancelled: bool = False


class ServeSink(Sink):
    """Per step: the streamed rows' text growth and step events, and the cancelled rows set free."""

    def __init__(self, engine: "Engine", requests: List[Request]):
        self.engine, self.requests = engine, requests
        self.streaming = [i for i, r in enumerate(requests) if r.stream_text or r.stream_steps]
        self.freed: set = set()
        self.stable = False
        self.first_token: Dict[int, float] = {}

    def on_start(self, canvas, info: dict) -> None:
        self.stable = str(self.requests[0].cfg.strategy.name) in PREFIX_STABLE

    def on_delta(self, delta, canvas) -> None:
        if self.engine.step_hook is not None:
            self.engine.step_hook(delta.step)
        self._free_cancelled(canvas)
        live = [i for i in self.streaming if i not in self.freed]
        if not live or delta.step == 0 and not any(self.requests[i].stream_steps for i in live):
            return
        g = canvas.gen_start
        idx = torch.as_tensor(live, device=canvas.device)
        G = canvas.tokens.shape[1] - g
        extra = torch.stack((canvas.row_nfe[idx], delta.active[idx].long()), 1)           # [n, 2]
        both = torch.cat((canvas.tokens[idx, g:], canvas.step_of[idx, g:].long(), extra), 1).cpu().numpy()  # one read
        tokens, steps, nfe, active = both[:, :G], both[:, G:2 * G], both[:, 2 * G], both[:, 2 * G + 1]
        for j, i in enumerate(live):
            req = self.requests[i]
            if delta.step > 0 and active[j]:
                req.own_steps.append(int(delta.step))
            self._emit_row(req, len(req.own_steps), int(nfe[j]), tokens[j], own_steps(steps[j], req.own_steps),
                           canvas)

    def _emit_row(self, req: Request, step: int, nfe: int, tokens: np.ndarray, steps: np.ndarray, canvas) -> None:
        lm = self.engine.lm
        masked = tokens == canvas.mask_id
        if req.stream_steps:
            prev = req.prev_tokens
            remasked = np.flatnonzero(masked & (prev != canvas.mask_id)) if prev is not None else np.zeros(0, int)
            edited = (np.flatnonzero(~masked & (prev != canvas.mask_id) & (prev != tokens))
                      if prev is not None else np.zeros(0, int))
            shown = np.where(masked, -1, tokens)
            req.emit("step", {"step": int(step), "nfe": int(nfe), "tokens": shown.tolist(),
                              "commit_step": steps.tolist(), "remasked": remasked.tolist(),
                              "edited": edited.tolist(), "masked": int(masked.sum())})
            req.prev_tokens = tokens.copy()
        if req.stream_text and self.stable:
            first_mask = int(np.argmax(masked)) if masked.any() else len(tokens)
            prefix = tokens[:first_mask]
            if lm.eos_id is not None:
                eos = np.flatnonzero(prefix == lm.eos_id)
                if eos.size:
                    prefix = prefix[:eos[0]]
            if len(prefix) > req.sent_tokens:        # (decoded only when the prefix grew)
                req.sent_tokens = len(prefix)
                text = lm.decode_text(prefix.tolist())
                if len(text) > len(req.sent_text) and text.startswith(req.sent_text):
                    req.emit("text", text[len(req.sent_text):])
                    req.sent_text = text

    def _free_cancelled(self, canvas) -> None:
        new = [i for i, r in enumerate(self.requests) if r.cancelled and i not in self.freed]
        if not new:
            return
        self.freed.update(new)
        if len(self.freed) == len(self.requests):
            raise _BatchCancelled()
        # the rows count as finished from here: the step loop reads them at its next read and leaves them out of
        # the forwards after it
        canvas.finished[torch.as_tensor(new, device=canvas.device)] = True
        self.engine.metrics.freed_rows(len(new))


def own_steps(step_of: np.ndarray, active_steps) -> np.ndarray:
    """Commit steps counted in a request's own steps (the batch steps it took part in, ``active_steps``
    ascending), as decoding it alone numbers them: a batch's step numbers run on while a request has finished
    or sits a step out. 0 (given) and -1 (masked) are kept."""
    act = np.asarray(active_steps, dtype=np.int64)
    so = np.asarray(step_of, dtype=np.int64)
    return np.where(so > 0, np.searchsorted(act, so, side="right"), so)


def batch_own_steps(log, B: int) -> List[List[int]]:
    """The batch steps each row took part in, from the batch's :class:`~dlm_engine.core.steps.BatchSteps`."""
    n = len(log)
    if not n:
        return [[] for _ in range(B)]
    act = torch.stack(log.active[:n]).bool().cpu().numpy().reshape(-1, B)
    steps = np.asarray(log.step[:n])
    return [steps[(steps > 0) & act[:, b]].tolist() for b in range(B)]


class Engine:
    """The model, the queue and the decode worker."""

    def __init__(self, lm, configs, server_cfg, out_dir: Path, metrics):
        self.lm, self.configs, self.server = lm, configs, server_cfg
        self.out_dir = Path(out_dir)
        self.metrics = metrics
        self.max_batch = int(server_cfg.max_batch_size)
        self.max_wait = float(server_cfg.max_batch_wait)
        self.queue_size = int(server_cfg.queue_size)
        self._queue: deque = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        self._batches = itertools.count()
        self._builders: Dict[str, Any] = {}
        self.decoding = 0                    # requests in the batch being decoded
        self.recent_batch_seconds = 0.0
        self.trace_dir = self.out_dir / "traces"
        self.step_hook: Optional[Callable[[int], None]] = None     # called every step (tests slow a decode down)

    # -- HTTP side -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dlm-serve-decode", daemon=True)
        self._thread.start()

    def submit(self, reqs: List[Request]) -> None:
        """Queue requests (all or none); QueueFull when they do not fit, ShuttingDown after :meth:`close`."""
        with self._cv:
            if self._closing:
                raise ShuttingDown()
            if len(self._queue) + len(reqs) > self.queue_size:
                raise QueueFull(self.retry_after())
            self._queue.extend(reqs)
            self.metrics.queue_depth(len(self._queue))
            self._cv.notify()

    def retry_after(self) -> int:
        """Seconds a client should wait after a 429: the queue's batches at the recent batch time."""
        per = max(self.recent_batch_seconds, 0.05)
        batches = (len(self._queue) + self.max_batch - 1) // max(1, self.max_batch)
        return max(1, int(np.ceil(per * max(1, batches))))

    def withdraw(self, req: Request) -> bool:
        """Take a request out of the queue (True) or mark it cancelled in its running batch (False)."""
        req.cancel()
        with self._cv:
            try:
                self._queue.remove(req)
            except ValueError:
                return False
            self.metrics.queue_depth(len(self._queue))
            return True

    @property
    def queued(self) -> int:
        return len(self._queue)

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop taking requests, decode the ones queued, stop the worker."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- worker ----------------------------------------------------------------------------------------
    def _take_batch(self) -> Optional[List[Request]]:
        with self._cv:
            while not self._queue:
                if self._closing:
                    return None
                self._cv.wait(0.5)
            first = self._queue[0]
            limit = self._limit(first)
            deadline = time.perf_counter() + self.max_wait
            while True:
                same = [r for r in self._queue if r.key == first.key][:limit]
                left = deadline - time.perf_counter()
                if len(same) >= limit or left <= 0 or self._closing:
                    break
                self._cv.wait(left)
                if first not in self._queue:      # withdrawn while waiting
                    return []
            for r in same:
                self._queue.remove(r)
            self.metrics.queue_depth(len(self._queue))
            return same

    def _limit(self, req: Request) -> int:
        from dlm_engine.serve.config import batch_limit

        make_strategy, _ = self._build(req)
        return batch_limit(req.cfg, make_strategy(), self.max_batch)[0]

    def _build(self, req: Request):
        got = self._builders.get(req.key)
        if got is None:
            from dlm_engine.app.run import build_cache, build_strategy

            got = self._builders[req.key] = (build_strategy(req.cfg), build_cache(req.cfg))
            if len(self._builders) > 256:
                self._builders.pop(next(iter(self._builders)))
        return got

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if not batch:
                continue
            live = [r for r in batch if not r.cancelled]
            if not live:
                continue
            try:
                self._decode(live)
            except BaseException as exc:         # one bad batch never ends the server
                log.exception("batch failed")
                from dlm_engine.serve.config import check_user_error

                msg = check_user_error(exc) or f"decode failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                for r in live:
                    r.emit("error", msg)
            finally:
                self.decoding = 0

    def _decode(self, reqs: List[Request]) -> None:
        from dlm_engine.app.api import decode_batch, rows_from_canvas, sync, torch_threads
        from dlm_engine.core.steps import BatchSteps

        lm, cfg = self.lm, reqs[0].cfg
        make_strategy, make_cache = self._build(reqs[0])
        ids = [r.prompt_ids for r in reqs]
        b = next(self._batches)
        self.decoding = len(reqs)
        log_ = BatchSteps()                  # the batch's one step table (metrics, own steps, and the trace)
        sink = ServeSink(self, reqs)
        sinks = [log_, sink]
        recorder = None
        trace_path = None
        if bool(cfg.trace.record):
            recorder, trace_path = self._open_recorder(cfg, reqs, ids, b)
            sinks = [sink, recorder.sink(0, list(range(len(reqs))), table=log_)]   # (the recorder's sink fills it)
        t0 = time.perf_counter()
        for r in reqs:
            r.started = t0
        self.metrics.batch(len(reqs))
        canvas = None
        try:
            with torch_threads(cfg.threads), (recorder if recorder is not None else contextlib.nullcontext()):
                torch.manual_seed(int(cfg.seed))
                try:
                    canvas = decode_batch(lm, ids, make_strategy(), make_cache(), int(cfg.gen_length), sinks,
                                          fast=bool(cfg.fast))
                except _BatchCancelled:
                    raise Cancelled() from None
                sync(lm.device)
        except Cancelled:
            for r in reqs:
                r.emit("error", "cancelled")
            self.metrics.cancelled_batch()
            return
        elapsed = time.perf_counter() - t0
        self.recent_batch_seconds = elapsed
        rows = rows_from_canvas(lm, canvas, ids, [r.prompt for r in reqs], 0, log_.metrics(canvas, lm.eos_id))
        for row, act in zip(rows, batch_own_steps(log_, len(reqs))):   # steps as decoding it alone numbers them
            row.step_of = own_steps(row.step_of, act).tolist()
            row.steps = int(own_steps([row.steps], act)[0])
        written = str(recorder.written_path) if recorder is not None else None
        self.metrics.decoded(canvas.nfe, elapsed)
        for r, row in zip(reqs, rows):
            if r.cancelled:
                r.emit("error", "cancelled")
                continue
            r.emit("done", Outcome(row=row, batch_size=len(reqs), queue_wait=t0 - r.arrived, decode_time=elapsed,
                                   trace=written))

    def _open_recorder(self, cfg, reqs, ids, b: int):
        from dlm_engine.app.recording import build_header
        from dlm_engine.trace.recorder import TraceRecorder

        t = cfg.trace
        header = build_header(cfg, self.lm, rows_expected=len(ids), prompt_length=max(len(p) for p in ids))
        header["shape"]["batch_size"] = len(ids)
        header["serve"] = {"batch": b, "requests": [r.id for r in reqs]}   # row i of the batch is request i
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.trace_dir / f"{stamp}-b{b:06d}-{reqs[0].id}.dlmt"
        rec = TraceRecorder(str(path), header, capture=t.capture, topk=t.topk, logit_error_bound=t.logit_error_bound,
                            queue_size=t.queue_size, recomputed=bool(t.recomputed))
        return rec, path
