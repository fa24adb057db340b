"""Finished rows stop costing work: the step loop runs the model on the active rows only.

Once some rows of a batch are finished (``Canvas.finished``: early exit, stop at EOS, or nothing left to
decode) the loop gathers the still-active rows of tokens / attention mask / position ids, runs the model
and the sampler on that smaller batch, and scatters the proposal back to the full batch, so strategies
keep seeing ``[B, ...]`` tensors. A finished row gets a proposal that can never be committed: ``x0`` is its
current token, its confidence ``-inf`` and its logits zero. When every row is finished but the strategy
still steps (e.g. LLaDA's zero-transfer steps at the end of a schedule) the loop runs that forward
uncached and discards it, as the reference does, so ``Canvas.nfe`` always equals the number of model calls.

``Canvas.row_nfe`` counts, per row, the forwards the row took part in (a finished row takes part in none). The work actually done is therefore ``sum(row_nfe)`` row-forwards
(times two with CFG), not ``nfe * batch``.

Row indices reach the cache as ``CallRequest.rows`` (a ``LongTensor`` of rows of the full model batch,
ascending; with CFG the unconditional copies are rows ``B + r``) together with ``CallRequest.full_batch``
(the size of that full batch). Both are None while every row is active, so
the common case costs nothing but one host read of the number of finished rows per step. Rows never come
back once finished, so a cache may drop the stored keys/values of rows that left the active set
(:class:`dlm_engine.core.kvcache.RowStore` does).

Random draws of the sampler (Gumbel noise, random confidences, the prefix cache's discarded draw) have
the shape of the active batch. A batched run at ``T > 0`` in which some rows finish early therefore uses
a different random stream from then on than a run that keeps every row in the batch (``decode(...,
compact=False)``); at ``T = 0``, and for every batch-1 run, the results are identical.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.core.devices import host_tensor
from dlm_engine.core.protocol import ForwardCall, recomputed_columns
from dlm_engine.core.sampler import Proposal


class ActiveRows:
    """Which rows the next model call runs, decided on the host from the finished rows the loop read and the
    plan's rows (a host sequence of flags, or None = every unfinished row): no device synchronisation. Index
    tensors are rebuilt only when the set changes."""

    def __init__(self, canvas: Canvas, compact: bool = True):
        self.batch, self.compact, self.device = canvas.batch_size, compact, canvas.device
        self._every_row = canvas.every_row
        self.vocab: Optional[Tuple[int, torch.dtype]] = None   # logits' last dim and dtype, once seen
        self.none_active = False
        self.mask: Optional[torch.Tensor] = None                 # [B] bool: the rows of the current call
        self.run: Tuple[bool, ...] = ()                          # host flags: the rows the current call runs
        self._memo = {}

    def _index(self, flags: Tuple[bool, ...]) -> Optional[torch.Tensor]:
        if all(flags):
            return None
        if flags not in self._memo:
            if len(self._memo) > 64:
                self._memo.clear()
            self._memo[flags] = host_tensor([i for i, f in enumerate(flags) if f], torch.long, self.device)
        return self._memo[flags]

    def rows_for(self, finished, wanted) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(live, rows)``: unfinished rows and the rows this step's call runs, as index tensors (None = all)."""
        alive = tuple(not f for f in finished) if self.compact else (True,) * self.batch
        self.none_active = self.vocab is not None and not any(alive)
        if self.none_active or self.vocab is None and not any(alive):
            self.mask = self._flags(tuple(not f for f in finished))
            return None, None
        run = alive if wanted is None else tuple(a and bool(w) for a, w in zip(alive, wanted))
        self.run = run
        live = self._index(alive)
        if not any(run):
            raise RuntimeError("a plan named no row that can run")
        # rows that take part (for NFE): finished rows run in the call when not compacting, but never count
        self.mask = self._flags(tuple(r and not f for r, f in zip(run, finished)))
        return live, (live if run == alive else self._index(run))

    def _flags(self, flags: Tuple[bool, ...]) -> torch.Tensor:
        if all(flags):
            return self._every_row()      # the canvas' own: Canvas.apply counts such a step on the host
        key = ("mask",) + flags
        if key not in self._memo:
            self._memo[key] = host_tensor(flags, torch.bool, self.device)
        return self._memo[key]

    def seen(self, logits: torch.Tensor) -> None:
        if self.vocab is None:
            self.vocab = (int(logits.shape[-1]), logits.dtype)


def call_rows(rows: torch.Tensor, batch: int, cfg: bool) -> Tuple[torch.Tensor, int]:
    """``(rows, full_batch)`` of a call that runs ``rows`` of a batch of ``batch`` (CFG doubles both)."""
    if cfg:
        return torch.cat([rows, rows + batch]), 2 * batch
    return rows, batch


def full_batch(values: torch.Tensor, rows: torch.Tensor, B: int, fill) -> torch.Tensor:
    """``[B, ...]``: the call rows' ``values`` at their canvas rows ``rows``, ``fill`` on the rows the call did
    not run."""
    return values.new_full((B,) + tuple(values.shape[1:]), fill).index_copy_(0, rows, values)


def expand_proposal(p: Proposal, rows: torch.Tensor, canvas: Canvas) -> Proposal:
    """A full-batch proposal from one over ``rows``; the other rows get uncommittable proposals."""
    B, W = canvas.batch_size, p.logits.shape[1]
    s = p.start
    x0 = None if p.x0 is None else canvas.tokens[:, s:s + W].index_copy(0, rows, p.x0)
    conf = None if p.confidence is None else full_batch(p.confidence, rows, B, float("-inf"))
    logits = full_batch(p.logits, rows, B, 0)
    valid = None if p.valid is None else full_batch(p.valid, rows, B, False)
    return Proposal(start=s, x0=x0, confidence=conf, logits=logits, call_len=p.call_len, call_start=p.call_start,
                    valid=valid, masked=p.masked, masked_confidence=p.masked_confidence)


def idle_proposal(canvas: Canvas, window: Tuple[int, int], vocab: Tuple[int, torch.dtype]) -> Proposal:
    """The proposal of a step in which every row is finished (no model call)."""
    s, e = window
    B, W = canvas.batch_size, e - s
    V, dtype = vocab
    return Proposal(start=s, x0=canvas.tokens[:, s:e].clone(),
                    confidence=torch.full((B, W), float("-inf"), device=canvas.device),
                    logits=torch.zeros((B, W, V), dtype=dtype, device=canvas.device), call_len=W, call_start=s)


def recomputed_rows(canvas: Canvas, call: Optional[ForwardCall], rows: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B, L]`` bool: the canvas columns whose keys/values ``call`` recomputed, per row of the full batch (rows the
    call did not run, and steps without a call: nothing; with CFG, the conditional rows)."""
    out = torch.zeros((canvas.batch_size, canvas.length), dtype=torch.bool, device=canvas.device)
    if call is None:
        return out
    rec = recomputed_columns(call)
    n = canvas.batch_size if rows is None else int(rows.numel())
    if rows is None:
        out.copy_(rec[:n])
    else:
        out[rows] = rec[:n]
    return out
