"""The opt-in fast layer: shortcuts a strategy may take on top of its plain rule, each checked against the plain
path (``decode(..., fast=False)``; tests/test_plain_fast.py decodes every strategy with every cache it pairs with
both ways and compares the deltas).

What lives here changes no result, only how much the step loop does on the device and reads back: a delta whose
finished rows are told from commit counts the host knows or reads in its one sync (:func:`counted_delta`,
:func:`pending_delta`) instead of a reduction over the canvas; confidences at a plan's masked positions only
(:func:`scored_window`, for a plan that sets ``StepPlan.masked``); the loop's host mirror of the canvas
(:mod:`dlm_engine.core.fast.mirror`: the finished rows as of its last read, handed to ``select`` as
``Proposal.finished_host``, and whether a canvas is still fresh, so that the first read is made on the host). A
strategy that does not call these gets the plain behaviour of :meth:`dlm_engine.core.strategy.Strategy.delta`. Under
``fast=False`` the loop recomputes such a delta's finished rows with the plain rule (:func:`plain_finished`), so any
disagreement shows as a different delta.
"""
from dlm_engine.core.fast.mirror import HostMirror, finished_before
from dlm_engine.core.fast.finished import counted_delta, host_finished, pending_delta, plain_finished
from dlm_engine.core.fast.scored import scored_window

__all__ = ["HostMirror", "counted_delta", "finished_before", "host_finished", "pending_delta",
           "plain_finished", "scored_window"]
