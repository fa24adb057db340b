"""Hydra multirun sweeps: per-job records and resume, scanning a sweep directory, tables and plots."""
