"""Trace recorder, file format and replayer (see docs/trace_format.md).

* :class:`TraceRecorder` — a sink of the FrameDelta stream (``recorder.sink(batch, rows)``).
* :func:`open_trace` — read a trace: sequences, ``state_at(t)``, ``step_of``, confidences, step tables.
"""
from .format import CAPTURE_LEVELS, TraceError
from .reader import Sequence, Trace, loads, open_trace
from .recorder import TraceRecorder

__all__ = ["CAPTURE_LEVELS", "TraceError", "TraceRecorder", "Trace", "Sequence", "open_trace", "loads"]
