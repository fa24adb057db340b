"""Trace recorder, file format and replayer (see docs/trace_format.md)."""
