"""The step loop's host mirror of a canvas (see :mod:`dlm_engine.core.fast`).

:class:`HostMirror` is what :func:`dlm_engine.core.loop.decode` knows about a canvas on the host without a read: the
finished rows as of the step's one synchronisation. The loop makes one per decode and hands its rows to the strategies
where it already hands them host values (``Proposal.finished_host`` in ``select``). ``Canvas`` itself keeps none of
this.
"""
from __future__ import annotations

import operator
import weakref
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

import torch

from dlm_engine.core.devices import host_constant

if TYPE_CHECKING:
    from dlm_engine.core.canvas import Canvas, FrameDelta

# canvas -> the mirror of the decode running on it (for code outside the loop that finishes rows between steps:
# :func:`live_mirror`)
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
