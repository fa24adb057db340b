"""The sampler's vocabulary-wide maximum by chunks on a CPU (a fast-layer shortcut; see
docs/decisions/row_max.md: a ``[32, 126,464]`` argmax in 0.37 ms instead of 2.1 ms on the 2-core VM)."""
from __future__ import annotations

import torch

from dlm_engine.core.fast.layer import fast_paths_on

# On a CPU torch's max/argmax over the last axis (value and index) runs one element at a time, while ``amax`` is
# vectorised (~10x faster): over a large vocabulary :func:`row_max` takes the maxima of ``MAX_CHUNK``-wide slices with
# ``amax``, then the first slice holding the row's maximum and the first maximum inside it -- the very index and value
# torch returns (its first maximum; the first NaN where a row has one). 2-4x faster from ~64k elements up.
MAX_CHUNK = 64
CHUNKED_MAX_MIN = 1 << 16          # elements: below this the extra calls cost more than they save
CHUNKED_MAX_MIN_V = 2048           # vocabulary: below this the per-row gathers cost more than they save


def row_max(x: torch.Tensor, values: bool = True):
    """``x.max(dim=-1)`` -- ``(values, indices)``, or the indices alone with ``values=False`` (``x.argmax(-1)``)
    -- computed by chunks on a CPU where that is faster (see ``MAX_CHUNK``); the same results bit for bit. The plain
    path (``decode(..., fast=False)``: :func:`~dlm_engine.core.fast.layer.fast_paths_on`) takes torch's own call."""
    V = x.shape[-1]
    if (not fast_paths_on() or V < CHUNKED_MAX_MIN_V or V % MAX_CHUNK or x.numel() < CHUNKED_MAX_MIN or x.device.type != "cpu"
            or not x.is_floating_point() or not x.is_contiguous()):     # (the cheapest tests first)
        return x.max(dim=-1) if values else x.argmax(dim=-1)
    return chunked_max(x, values)


def chunked_max(x: torch.Tensor, values: bool = True):
    """:func:`row_max` by ``MAX_CHUNK``-wide chunks (``x`` contiguous, its last axis a multiple of the chunk)."""
    lead, C = x.shape[:-1], MAX_CHUNK
    chunks = x.view(-1, x.shape[-1] // C, C)
    N = chunks.shape[0]
    first = chunks.amax(-1).argmax(-1)            # the first chunk whose maximum is the row's (NaN: the first NaN)
    seg = chunks.gather(1, first.view(N, 1, 1).expand(N, 1, C)).view(N, C)
    if values:
        val, at = seg.max(dim=-1)
        return val.view(lead), first.mul_(C).add_(at).view(lead)
    return first.mul_(C).add_(seg.argmax(dim=-1)).view(lead)
