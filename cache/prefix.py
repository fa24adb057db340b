"""``cache=prefix``: Fast-dLLM's prefix cache (and the d2Cache framework's ``PrefixCache``).

At a block start (``directive.block_start``) the whole canvas is run and every layer's keys/values are
stored. On the following (cached) steps only the columns ``[s, L)`` — the current block and everything
after it — are recomputed; the keys/values of the prefix ``[0, s)`` stay those of the block-start call.

Models with shifted logits (Dream: column ``j`` is read from hidden state ``j - 1``) need one more choice,
``shifted``:

* ``extend`` (Fast-dLLM's Dream loop): recompute ``[s - 1, L)`` -- the span plus the column before it.
* ``move`` (the d2Cache framework): recompute ``[s - 1, L - 1)`` -- the span moved one column to the left,
  so exactly the hidden states whose logits are wanted are queried and the last canvas column is never
  recomputed after the block start (its keys/values stay stale).

Both are the same mechanism (frozen prefix, recomputed block + suffix); with LLaDA they are identical.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.devices import host_tensor
from dlm_engine.core.kvcache import StoredKVCache
from dlm_engine.core.registry import register_cache


class Shifted(str, Enum):
    """How a span cache queries a shifted-logit model (Dream)."""

    extend = "extend"     # also recompute the column before the span (Fast-dLLM)
    move = "move"         # recompute the span moved left by the shift (d2Cache's PrefixCache)


@dataclass
class PrefixCacheConfig:
    refresh_interval: int = 0    # also refresh every n-th step of a block (0 = only at block starts)
    wasted_draw: bool = True     # Fast-dLLM's discarded Gumbel draw on cached steps at T > 0 (RNG parity)
    shifted: Shifted = Shifted.extend   # shifted-logit models: extend (Fast-dLLM) | move (d2Cache)


class SpanCache(StoredKVCache):
    """Base of ``prefix`` and ``dual``: the recomputed span ``[a, b)`` of a cached step, moved left by the
    model's logit shift when ``shifted=move``."""

    @property
    def extend_for_shift(self) -> bool:
        return Shifted(self.cfg.shifted) == Shifted.extend

    def cached_span(self, call, d):
        raise NotImplementedError

    def compute_span(self, call, d, refresh):
        L = call.input_ids.shape[1]
        if refresh:
            return 0, L, L
        a, b = self.cached_span(call, d)
        if not self.extend_for_shift:
            a, b = max(a - call.logits_shift, 0), b - call.logits_shift
        return a, b, L

    def row_spans(self, lo: np.ndarray, hi: np.ndarray, L: int):
        """:meth:`cached_span` of every row at once, from the rows' own blocks ``[lo, hi)`` (host arrays)."""
        raise NotImplementedError

    def row_columns(self, call, d, fresh):
        """Each row recomputes what it would alone: everything when its own block starts (or its refresh interval
        is due), else its own span; the call computes the union, and a row writes fresh keys/values only in its
        own span (:class:`~dlm_engine.core.kvcache.StoredKVCache`). Host arrays, every row at once."""
        L, shift = call.input_ids.shape[1], call.logits_shift
        lo, hi = (np.asarray(x, dtype=np.int64) for x in np.asarray(d.row_blocks).T)
        refresh = np.asarray(d.row_block_start, dtype=bool) | fresh
        n = int(getattr(self.cfg, "refresh_interval", 0) or 0)
        if n > 0:
            refresh = refresh | (np.asarray(d.row_step_in_block) % n == 0)
        a, b = self.row_spans(lo, hi, L)
        if shift and self.extend_for_shift:     # (as forward widens a lone row's span to its window's first logit)
            a = np.where((lo - shift >= 0) & (lo - shift < a), lo - shift, a)
        elif shift:
            a, b = np.maximum(a - shift, 0), b - shift
        own = (lo < hi) | refresh
        a, b = np.where(refresh, 0, a), np.where(refresh, L, b)
        if not own.any():
            return None
        cols = np.arange(L)
        mask = own[:, None] & (cols >= a[:, None]) & (cols < b[:, None])
        req = call.request
        if req.full_batch is not None and int(req.full_batch) == 2 * len(lo):   # CFG: the unconditional copies
            mask = np.concatenate([mask, mask])
        t = host_tensor(mask, torch.bool, call.input_ids.device)
        if req.rows is not None:
            t = t.index_select(0, req.rows.to(t.device))
        return int(a[own].min()), int(b[own].max()), L, bool(refresh.all()), t


@register_cache("prefix", PrefixCacheConfig)
class PrefixCache(SpanCache):
    offers = caps(Cap.BLOCK_LOGITS, Cap.SUFFIX_LOGITS)

    def cached_span(self, call, d):
        return d.block[0], call.input_ids.shape[1]

    def row_spans(self, lo, hi, L):
        return lo, np.full_like(hi, L)

    def after_call(self, call, d, refresh):
        if not refresh and self.cfg.wasted_draw:
            call.discard_draws = 1
