"""Trace recorder, file format and replayer (see docs/trace_format.md).

* :class:`TraceRecorder` — a sink of the FrameDelta stream (``recorder.sink(batch, rows)``).
* :func:`open_trace` — read a trace: sequences, ``state_at(t)``, ``step_of``, confidences, step tables.

Reading needs only numpy and zstandard: the recorder (which needs torch) is imported on first use.
"""
from .format import CAPTURE_LEVELS, TraceError
from .reader import Sequence, Trace, loads, open_trace

__all__ = ["CAPTURE_LEVELS", "TraceError", "TraceRecorder", "Trace", "Sequence", "open_trace", "loads"]


def __getattr__(name):
    if name == "TraceRecorder":
        from .recorder import TraceRecorder

        return TraceRecorder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
