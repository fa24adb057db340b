"""Finished rows told from commit counts (see :mod:`dlm_engine.core.fast`)."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from dlm_engine.core.canvas import Canvas, FrameDelta
from dlm_engine.core.devices import host_tensor
from dlm_engine.core.fast.mirror import finished_before
from dlm_engine.core.sampler import Proposal
from dlm_engine.core.strategy import frame, masked_after


def counted_delta(canvas: Canvas, proposal: Proposal, commit: torch.Tensor, masked_left: Sequence[int], *,
                  committed: Optional[torch.Tensor] = None, committed_host: Optional[Sequence[int]] = None,
                  **plain) -> FrameDelta:
    """:meth:`Strategy.delta <dlm_engine.core.strategy.Strategy.delta>` (``plain``: its keywords but ``finished``
    and ``remask``) for a ``commit`` of masked positions only, whose finished rows are told from counts instead of a
    reduction over the canvas: a row finishes when it commits as many positions as it had masked
    (``masked_left``: per row, on the host, the masked generated positions before this delta -- the last host
    read).

    ``committed_host``: the commits per row known exactly on the host: the finished rows are decided there
    (``FrameDelta.finished_host``; no operation when none finishes). Else ``committed`` (``commit.sum(-1)`` if not
    given) is left for the loop to read in its one sync (``FrameDelta.finished_counts``; a strategy that asks for
    the same tensor reads it once). Rows finished before are told by ``proposal.finished_host``, which the step loop
    sets from its host mirror (a caller outside :func:`dlm_engine.core.loop.decode` sets it where rows are finished).
    A caller that changes ``finished`` afterwards (an EOS stop) builds a new delta."""
    before = finished_before(proposal, canvas.batch_size)
    if committed_host is not None:
        fin, finished = host_finished(canvas, committed_host, masked_left, before)
        delta = frame(canvas, proposal, commit, finished, **plain)
        delta.finished_host = fin
    else:
        n = commit.sum(-1) if committed is None else committed
        delta = frame(canvas, proposal, commit, None, **plain)
        delta.finished_counts = (n, tuple(-1 if f else m for m, f in zip(masked_left, before)))
    delta.counted = True
    return delta


def pending_delta(canvas: Canvas, proposal: Proposal, commit: torch.Tensor,
                  counts: Tuple[torch.Tensor, Sequence[int]], **plain) -> FrameDelta:
    """:meth:`Strategy.delta` whose ``finished`` is left to ``counts = (counts, target)`` (``FrameDelta.finished_counts``:
    row b finishes when its counts sum to ``target[b]``, -1 never), where those counts are the masked generated
    positions per row (and block) once the delta is applied and the target 0 (-1 for rows finished before)."""
    delta = frame(canvas, proposal, commit, None, **plain)
    delta.finished_counts = (counts[0], tuple(counts[1]))
    delta.counted = True
    return delta


def host_finished(canvas: Canvas, committed: Sequence[int], masked_left: Sequence[int], before: Sequence[bool]):
    """``(rows, tensor)``: the rows a step finishes, told on the host from its commits per row (``committed``, all
    masked positions) and the masked positions each row had left (``masked_left``): a row not finished before
    (``before``: ``Proposal.finished_host``, see :func:`dlm_engine.core.fast.mirror.finished_before`) finishes when it
    commits all it had left. The tensor is ``[B]`` bool (:meth:`Canvas.no_rows`, no operation,
    when none finishes)."""
    fin = tuple(not f and n == m for n, m, f in zip(committed, masked_left, before))
    return fin, (host_tensor(fin, torch.bool, canvas.device) if any(fin) else canvas.no_rows())


def plain_finished(canvas: Canvas, delta: FrameDelta) -> None:
    """The plain path's check of a counted delta (``delta.counted``), before it is applied: its finished rows
    recomputed with the plain rule of :meth:`Strategy.delta` (no masked generated position left, not finished
    before), the fast fields cleared."""
    delta.finished = masked_after(canvas, delta.start, delta.commit, delta.remask).any(dim=-1).logical_or_(
        canvas.finished).logical_not_()
    delta.finished_counts = delta.finished_host = None
    delta.counted = False
