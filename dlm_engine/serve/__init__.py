"""dlm-serve: an OpenAI-compatible HTTP server over the Python API (docs/serving.md)."""
