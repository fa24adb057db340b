"""The application layer: the ``dlm`` Hydra app and CLI, the Python API, run configs, tasks and sinks."""
