"""The one per-step table of a batch: step, NFE, wall time, active and finished rows, and the step scalars, taken
from each :class:`~dlm_engine.core.canvas.FrameDelta` once.

Both readers of these facts read this table: the per-sequence metrics (:meth:`BatchSteps.metrics`, through
:func:`dlm_engine.metrics.batch_metrics`) and the trace recorder, whose batch sink owns the batch's table (it
appends each delta before handing it to the writer thread, which encodes slices of the table as the file's step
tables; the recorder keeps only what the table has not -- a step's window start and width, its block events -- as
columns of its own). A decode with a trace builds exactly one table a batch (``sink.step_table`` of the
recorder's sink; :func:`batch_steps` finds it); one without a trace adds a table as a sink of its own.

The rows are kept as the deltas gave them (``active`` / ``finished`` and tensor scalars stay on the device, no
synchronisation in the step loop); the lists only grow, so a reader on another thread may read the rows it
knows exist while the step loop appends.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from dlm_engine.core.canvas import Canvas, FrameDelta
from dlm_engine.core.loop import Sink


class BatchSteps(Sink):
    """Per-step records of one batch, by column (row ``i``: the batch's ``i``-th delta). A trace gives the same
    columns back, as written, in :class:`dlm_engine.trace.reader.StepTable`."""

    def __init__(self):
        self.step: List[int] = []
        self.nfe: List[int] = []
        self.wall: List[float] = []          # decode wall time (s) at the step's end
        self.active: List[Any] = []          # [B] bool tensors
        self.finished: List[Any] = []        # [B] bool tensors
        self.scalars: List[Dict[str, Any]] = []   # the step's scalars by name (the delta's dict)

    def __len__(self) -> int:
        return len(self.step)

    def on_delta(self, delta: FrameDelta, canvas: Canvas) -> None:
        self.append(delta)

    def append(self, delta: FrameDelta) -> int:
        """Add the delta's row; returns its index. (``step`` last: a row counts once every column has it.)"""
        self.nfe.append(int(delta.nfe))
        self.wall.append(float(delta.wall_time))
        self.active.append(delta.active)
        self.finished.append(delta.finished)
        self.scalars.append(delta.scalars if delta.scalars is not None else {})
        self.step.append(int(delta.step))
        return len(self.step) - 1

    def values(self, name: str, a: int = 0, b: Optional[int] = None) -> List[Any]:
        """A step scalar's values of rows ``a:b`` (None where a step has none)."""
        return [s.get(name) for s in self.scalars[a:b]]

    def metrics(self, canvas: Canvas, eos_id):
        """Per-sequence metrics of the batch (:func:`dlm_engine.metrics.batch_metrics`) from the table and the
        final canvas."""
        import torch

        from dlm_engine.metrics import batch_metrics

        g = canvas.gen_start
        n = len(self.step)
        stack = (lambda xs: torch.stack(xs[:n]).bool().cpu().numpy()) if n else (lambda xs: None)
        B = canvas.batch_size
        edits = post = None
        ed, pe = self.values("edits", 0, n), self.values("post_edit", 0, n)
        if any(e is not None for e in ed):
            edits = np.stack([np.broadcast_to(e, (B,)) if e.size in (1, B) else np.zeros(B, np.int64)
                              for e in map(_int_vector, ed)])
        if any(p is not None for p in pe):
            post = np.array([int(p or 0) for p in pe])
        return batch_metrics(self.step[:n], self.nfe[:n], stack(self.active), stack(self.finished), self.wall[:n],
                             canvas.step_of[:, g:].cpu().numpy(), canvas.tokens[:, g:].cpu().numpy(), eos_id,
                             edits=edits, post_edit=post)


def batch_steps(sinks: Sequence[Any]) -> Optional[BatchSteps]:
    """The step table a batch's sinks already keep (a trace recorder's sink owns one: ``step_table``), or None."""
    for s in sinks:
        t = getattr(s, "step_table", None)
        if isinstance(t, BatchSteps):
            return t
    return None


def _int_vector(x):
    """A step scalar as a numpy int vector (0 when the step has none)."""
    if x is None:
        return np.zeros(1, dtype=np.int64)
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)
