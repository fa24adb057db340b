"""The step loop's host mirror of a canvas (see :mod:`dlm_engine.core.fast`).

:class:`HostMirror` is what :func:`dlm_engine.core.loop.decode` knows about a canvas on the host without a read: the
finished rows as of the step's one synchronisation. The loop makes one per decode and hands its rows to the strategies
where it already hands them host values (``Proposal.finished_host`` in ``select``). :func:`is_fresh` tells whether a
canvas is still the one :meth:`Canvas.from_prompts <dlm_engine.core.canvas.Canvas.from_prompts>` made, from torch's
version counters noted at its birth (:func:`note_fresh`), so that the loop may make its first read on the host
(:meth:`Strategy.fresh_values <dlm_engine.core.strategy.Strategy.fresh_values>`). ``Canvas`` itself keeps none of
this.
"""
from __future__ import annotations

import operator
import weakref
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

import torch

from dlm_engine.core.devices import host_constant

if TYPE_CHECKING:   # (canvas.py calls note_fresh: no import of it at module level)
    from dlm_engine.core.canvas import Canvas, FrameDelta

# canvas -> (its tensors, their version counters) when from_prompts made it; canvas -> the mirror of the decode
# running on it (for code outside the loop that finishes rows between steps: :func:`live_mirror`)
_BORN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class HostMirror:
    """The loop's host copy of a canvas' finished rows (``finished``: one flag per row, as of the step's one read;
    rows finished by the step's delta are in it once :func:`dlm_engine.core.loop.sync_round` returns)."""

    __slots__ = ("finished", "__weakref__")

    def __init__(self, batch: int):
        self.finished: Tuple[bool, ...] = (False,) * batch

    def add(self, rows: Sequence[bool]) -> Tuple[bool, ...]:
        """``finished`` with ``rows`` finished too (rows known on the host, e.g. ``FrameDelta.finished_host``)."""
        self.finished = tuple(map(operator.or_, self.finished, rows))
        return self.finished

    def finish_rows(self, canvas: "Canvas", delta: "FrameDelta", counts: Sequence) -> Tuple[bool, ...]:
        """Tell an applied delta's ``finished`` from its ``finished_counts`` with the counts read on the host
        (``counts``, row-major), apply it to ``canvas.finished`` (nothing on the device when no row finishes) and
        return the rows finished after it, kept as ``finished``."""
        target = delta.finished_counts[1]
        k = len(counts) // len(target)
        sums = counts if k == 1 else [sum(counts[i:i + k]) for i in range(0, len(counts), k)]
        fin = tuple(m >= 0 and v == m for v, m in zip(sums, target))
        if any(fin):
            delta.finished = host_constant(fin, torch.bool, canvas.device)
            canvas.finished |= delta.finished
            return self.add(fin)
        delta.finished = canvas.no_rows()
        return self.finished

    def attach(self, canvas: "Canvas") -> None:
        """Make this the mirror :func:`live_mirror` returns while the loop decodes ``canvas``."""
        _LIVE[canvas] = self

    def detach(self, canvas: "Canvas") -> None:
        if _LIVE.get(canvas) is self:
            del _LIVE[canvas]


def live_mirror(canvas: "Canvas") -> Optional[HostMirror]:
    """The mirror of the decode running on ``canvas`` (None outside a decode)."""
    return _LIVE.get(canvas)


def finished_before(proposal, batch: int) -> Tuple[bool, ...]:
    """The rows finished before a step, on the host: ``proposal.finished_host`` as the loop set it (a proposal made
    outside the loop, with none: no row)."""
    fin = getattr(proposal, "finished_host", None)
    return (False,) * batch if fin is None else fin


def _versions(canvas: "Canvas") -> Optional[tuple]:
    # (the tensors, their in-place version counters); inference tensors keep no counter: then None
    ts = (canvas.tokens, canvas.step_of, canvas.finished)
    try:
        return ts + tuple(t._version for t in ts)
    except RuntimeError:
        return None


def note_fresh(canvas: "Canvas") -> None:
    """Remember ``canvas`` as fresh (called by ``Canvas.from_prompts``: its masked positions are exactly the
    generation of every row and no row is finished)."""
    v = _versions(canvas)
    if v is not None:
        _BORN[canvas] = v


def is_fresh(canvas: "Canvas") -> bool:
    """True while nothing has changed the canvas :meth:`Canvas.from_prompts` made (no step, no set-up delta, no
    in-place edit or replaced tensor, tracked by torch's version counters): the host then knows its masked positions
    and that no row is finished without a read. Writes that bypass torch's counters (through ``.data``,
    ``.numpy()`` or DLPack views) are not seen: change a canvas with torch operations (``canvas_hook`` of
    ``decode_batch`` included)."""
    f = _BORN.get(canvas)
    if f is None or canvas.step or canvas.nfe:
        return False
    now = _versions(canvas)
    return now is not None and all(a is b for a, b in zip(now[:3], f[:3])) and now[3:] == f[3:]
