"""The base of the fast layer's mixins, and the switch that turns them off (see :mod:`dlm_engine.core.fast`).

A strategy module holds its plain rule: ``plan`` / ``select``, what the next plan must know on the host
(``reads`` / ``settle``: counted on the canvas after every step) and deltas made with :meth:`Strategy.delta
<dlm_engine.core.strategy.Strategy.delta>`. A strategy opts into shortcuts by listing a :class:`FastLayer` mixin
before its policy class (``class D2C(ScoredBlock, D2CRule)``). A mixin overrides the policy's seams only: each of its
methods first asks :attr:`FastLayer.fast_on`, and :func:`plain_policy` hands the step loop a copy with it off
(``decode(..., fast=False)``), which then runs the policy's own methods. ``tests/test_plain_fast.py`` decodes every
strategy both ways and compares the deltas.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy


class FastLayer:
    """Base of the fast layer's mixins. ``fast_on``: the mixin's overrides are in force (False on the copy
    :func:`plain_policy` makes)."""

    fast_on: bool = True


def plain_policy(strategy):
    """``strategy`` with its fast mixins turned off (a shallow copy; the strategy itself when it has none): the
    plain rule of its module, what ``decode(..., fast=False)`` runs."""
    if not isinstance(strategy, FastLayer) or not strategy.fast_on:
        return strategy
    plain = copy.copy(strategy)
    plain.fast_on = False
    return plain


# whether the decode running in this context takes the fast layer's shortcuts outside the strategies (the sampler's
# chunked maximum): set by :func:`dlm_engine.core.loop.decode` for its steps
_FAST_PATHS = contextvars.ContextVar("dlm_engine_fast_paths", default=True)


def fast_paths_on() -> bool:
    """False inside ``decode(..., fast=False)``: shared helpers then take the plain call."""
    return _FAST_PATHS.get()


@contextlib.contextmanager
def fast_paths(on: bool):
    """Run the block with the fast layer's shared shortcuts on or off (:func:`fast_paths_on`)."""
    token = _FAST_PATHS.set(bool(on))
    try:
        yield
    finally:
        _FAST_PATHS.reset(token)
