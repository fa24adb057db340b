"""The opt-in fast layer: shortcuts that change no result, apart from the plain rules, each checked against the
plain path (``decode(..., fast=False)``; tests/test_plain_fast.py decodes every strategy with every cache it pairs
with both ways and compares the deltas step by step).

* :mod:`~dlm_engine.core.fast.layer`: :class:`FastLayer`, the base of a strategy's fast mixins (listed before its
  policy class; each override first asks ``fast_on``), and :func:`plain_policy`, the copy with them off.
* :mod:`~dlm_engine.core.fast.block_scored`: d2c's mixins that sample only the positions its rule reads (the
  block's candidates; KLASS from the block's first column on) instead of every generated position.
* :mod:`~dlm_engine.core.fast.scored`: the loop's confidences at a plan's masked positions only
  (``StepPlan.masked``) instead of the whole window.

What a shortcut saves is measured with ``experiments/bench_overhead.py --model d256`` with and without ``--plain``.
"""
from dlm_engine.core.fast.layer import FastLayer, plain_policy
from dlm_engine.core.fast.scored import scored_window

__all__ = ["FastLayer", "plain_policy", "scored_window"]
