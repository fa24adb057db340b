"""The opt-in fast layer: shortcuts that change no result, apart from the plain rules, each checked against the
plain path (``decode(..., fast=False)``; tests/test_plain_fast.py decodes every strategy with every cache it pairs
with both ways and compares the deltas step by step).

* :mod:`~dlm_engine.core.fast.layer`: :class:`FastLayer`, the base of a strategy's fast mixins (listed before its
  policy class; each override first asks ``fast_on``), and :func:`plain_policy`, the copy with them off.
* :mod:`~dlm_engine.core.fast.block_scored`: d2c's mixins that sample only the positions its rule reads (the
  block's candidates; KLASS from the block's first column on) instead of every generated position.
* :mod:`~dlm_engine.core.fast.scored`: the loop's confidences at a plan's masked positions only
  (``StepPlan.masked``) instead of the whole window.
* :mod:`~dlm_engine.core.fast.row_max`: the sampler's vocabulary-wide maximum by chunks on a CPU.

The loop sets whether a decode takes them (:func:`~dlm_engine.core.fast.layer.fast_paths`); the mixins ask their own
``fast_on``.

What a shortcut saves is measured with ``experiments/bench_overhead.py --model d256`` with and without ``--plain``.
"""
from dlm_engine.core.fast.layer import FastLayer, fast_paths, fast_paths_on, plain_policy

__all__ = ["FastLayer", "fast_paths", "fast_paths_on", "plain_policy"]
