"""Sinks of the FrameDelta stream that ship with the app: a progress bar, and a recorder of every delta. (The
batch's per-step table, which the metrics and the trace recorder read, is :class:`dlm_engine.core.steps.BatchSteps`.)"""
from __future__ import annotations

import logging
import sys
import time

from typing import Optional

from dlm_engine.core.canvas import Canvas, FrameDelta
from dlm_engine.core.loop import Sink


class ProgressSink(Sink):
    """tqdm bar over prompts on a terminal; elsewhere (pipes, files, batch jobs, launcher workers) a log line
    at most every ``log_interval`` seconds -- checked at every step, so a long batch is not silent -- and one
    when the last prompt is done: ``decoded 40/200 prompts (12.1 s, 3.3 prompts/s, ETA 48 s)``; ``start``, a line
    logged at once (``decoding 200 prompts, batch 8, strategy threshold, cache dual``).

    ``enabled=None`` (auto): a bar only on a terminal and never in a parallel/remote Hydra launcher worker;
    ``enabled=False`` (``progress=false``): silent. Lines go through ``logging`` (``dlm_engine.progress``);
    Hydra sends them to the terminal and the job's log file.
    """

    def __init__(self, total: int, enabled: Optional[bool] = None, desc: str = "decode",
                 log_lines: Optional[bool] = None, log_interval: float = 30.0, start: Optional[str] = None):
        from tqdm.auto import tqdm

        auto = enabled is None
        if enabled is None:
            from dlm_engine.app.jobs import in_launcher_worker

            enabled = sys.stderr.isatty() and not in_launcher_worker()
        if log_lines is None:
            log_lines = auto and not enabled
        self.log_lines, self.log_interval, self.total, self.done = log_lines, float(log_interval), total, 0
        self.t0 = self.last_log = time.perf_counter()
        self.bar = tqdm(total=total, desc=desc, unit="prompt", disable=not enabled, leave=False, file=sys.stderr)
        if log_lines and start:      # without a bar, say at once what runs (the first progress line may be minutes away)
            logging.getLogger("dlm_engine.progress").info("%s", start)

    def on_delta(self, delta: FrameDelta, canvas: Canvas) -> None:
        if not self.bar.disable and delta.step % 8 == 0:
            self.bar.set_postfix(step=delta.step, refresh=False)
        if self.log_lines and time.perf_counter() - self.last_log >= self.log_interval:
            self._log(f" (batch of {canvas.batch_size} at step {delta.step})")

    def on_end(self, canvas: Canvas) -> None:
        self.bar.update(canvas.batch_size)
        self.done += canvas.batch_size
        if self.log_lines and (self.done >= self.total or time.perf_counter() - self.last_log >= self.log_interval):
            self._log("")

    def _log(self, where: str) -> None:
        now = time.perf_counter()
        self.last_log = now
        elapsed = now - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = f"ETA {format_seconds((self.total - self.done) / rate)}" if rate > 0 else "ETA unknown"
        logging.getLogger("dlm_engine.progress").info(
            "decoded %d/%d prompts (%s, %.1f prompts/s, %s)%s", self.done, self.total, format_seconds(elapsed),
            rate, eta, where)

    def close(self) -> None:
        self.bar.close()


def format_seconds(s: float) -> str:
    s = max(0.0, float(s))
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


class RecordingSink(Sink):
    """Keeps every delta (tests and notebooks)."""

    def __init__(self):
        self.deltas = []
        self.states = []

    def on_delta(self, delta: FrameDelta, canvas: Canvas) -> None:
        self.deltas.append(delta)
        self.states.append(canvas.tokens.clone())
