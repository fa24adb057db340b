"""Sinks of the FrameDelta stream that ship with the core: a progress bar and metrics."""
from __future__ import annotations

import sys
from typing import Optional

from .canvas import Canvas, FrameDelta
from .loop import Sink


class ProgressSink(Sink):
    """tqdm bar over prompts, with the current step; silent when stderr is not a terminal."""

    def __init__(self, total: int, enabled: Optional[bool] = None, desc: str = "decode"):
        from tqdm.auto import tqdm

        if enabled is None:
            enabled = sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=desc, unit="prompt", disable=not enabled, leave=False, file=sys.stderr)

    def on_delta(self, delta: FrameDelta, canvas: Canvas) -> None:
        if not self.bar.disable and delta.step % 8 == 0:
            self.bar.set_postfix(step=delta.step, refresh=False)

    def on_end(self, canvas: Canvas) -> None:
        self.bar.update(canvas.batch_size)

    def close(self) -> None:
        self.bar.close()


class MetricsSink(Sink):
    """Counts steps, forward passes and commits per step (for benchmarks and summaries)."""

    def __init__(self):
        self.steps = 0
        self.nfe = 0
        self.commits = []
        self.scalars = []

    def on_delta(self, delta: FrameDelta, canvas: Canvas) -> None:
        self.steps += 1
        self.nfe += delta.nfe
        self.commits.append(delta.commit.sum(-1))
        self.scalars.append(delta.scalars)


class RecordingSink(Sink):
    """Keeps every delta (tests and notebooks)."""

    def __init__(self):
        self.deltas = []
        self.states = []

    def on_delta(self, delta: FrameDelta, canvas: Canvas) -> None:
        self.deltas.append(delta)
        self.states.append(canvas.tokens.clone())
