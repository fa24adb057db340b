"""Helpers of the caches that keep per-row tensors and recompute a chosen set of positions per row.

A store tensor holds every row the :class:`~dlm_engine.core.kvcache.RowStore` holds; a call may run only some
of them (``RowStore.index``). :func:`rows_of` reads the call's rows, :func:`scatter_columns` writes fresh values
at per-row column indices, :func:`padded_index` turns a per-row selection mask into the ``[B, Q]`` index the
protocol takes (same count per row).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from dlm_engine.core.kvcache import RowStore


def key_columns(call_state: Dict, T: int, device) -> torch.Tensor:
    """The key columns ``arange(T)`` of a call, one tensor for every layer (kept in the cache's per-call
    ``call_state``): layers with the same query rows then share one attention mask (``layers._memo_mask`` keys
    on tensor identity)."""
    cols = call_state.get("key_columns")
    if cols is None:
        cols = call_state["key_columns"] = torch.arange(T, device=device)
    return cols


def rows_of(store: RowStore, t: torch.Tensor) -> torch.Tensor:
    """The call's rows of a store tensor (the tensor itself when the call runs every held row)."""
    return t if store.index is None else t[store.index]


def put_rows(store: RowStore, t: torch.Tensor, value: torch.Tensor) -> None:
    """Write the call's rows of a store tensor."""
    if store.index is None:
        t.copy_(value)
    else:
        t[store.index] = value


def tensor_for(tensors: Dict[int, torch.Tensor], layer: int, store: RowStore, shape: Tuple[int, ...],
               like: torch.Tensor) -> torch.Tensor:
    """``tensors[layer]`` for every held row (``shape`` without the row dimension), allocated on first use."""
    t = tensors.get(layer)
    if t is None or t.shape[1:] != tuple(shape) or t.dtype != like.dtype or t.device != like.device:
        t = tensors[layer] = store.alloc((0,) + tuple(shape), like)
    return t


def scatter_columns(store: RowStore, t: torch.Tensor, dim: int, index: Optional[torch.Tensor], value: torch.Tensor,
                    keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write ``value`` (the call's rows, ``index.shape[1]`` entries along ``dim``) at the per-row columns ``index``
    (``[b, Q]``; None = every column) of store tensor ``t``; returns the call's rows of the updated tensor.

    ``keep`` (``[b, Q]`` bool) marks entries to write; the others write back what is stored (padding entries of
    a row that selected nothing point at a column no real entry writes)."""
    if index is None:
        put_rows(store, t, value)
        return value
    cur = rows_of(store, t)
    shape = [1] * t.dim()
    shape[0], shape[dim] = index.shape
    idx = index.view(shape).expand(value.shape)
    if keep is not None:
        value = torch.where(keep.view(shape).expand(value.shape), value, cur.gather(dim, idx))
    cur = cur.scatter(dim, idx, value) if store.index is not None else cur.scatter_(dim, idx, value)
    if store.index is not None:
        t[store.index] = cur
    return cur


def padded_index(sel: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(index [B, Q], keep [B, Q] or None)`` of a selection mask ``[B, T]`` whose rows may select different
    counts: each row's selected columns ascending, padded to the largest count with copies of its first one
    (recomputing a column twice writes the same values twice); a row that selected nothing points at column 0
    with ``keep`` False. One host read (the largest count)."""
    counts = sel.sum(-1)
    q = int(counts.max())
    order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices[:, :q]
    slot = torch.arange(q, device=sel.device)[None, :]
    real = slot < counts[:, None]
    first = torch.where(counts > 0, order[:, 0], torch.zeros_like(order[:, 0]))
    index = torch.where(real, order, first[:, None])
    empty = counts == 0
    keep = None if not bool(empty.any()) else ~empty[:, None].expand_as(index)
    return index, keep
