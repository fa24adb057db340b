"""Base class of KV caches. A cache is the model's hooks object (see :mod:`dlm_engine.core.protocol`)
plus ``begin``/``end`` around one decode. Concrete caches live in ``cache/`` and register themselves
with :func:`dlm_engine.core.registry.register_cache`.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, ClassVar, Tuple

import torch

from dlm_engine.errors import ConfigError
from dlm_engine.core.protocol import NullHooks


class Cache(NullHooks):
    name: ClassVar[str] = ""
    Config: ClassVar[type] = object

    def __init__(self, config: Any = None):
        self.cfg = config

    def begin(self, canvas) -> None:
        """Forget everything stored for a previous decode."""

    def end(self, canvas) -> None:
        """Release what was stored."""


class StoredKVCache(Cache):
    """Base of caches that keep every layer's keys/values for all canvas columns.

    Each call computes one column span ``[a, b)`` (chosen by :meth:`compute_span`); in every layer the
    fresh keys/values of that span are written into the stored tensors (in place) and attention runs over
    the stored keys of columns ``[0, key_end)``. The key padding mask and the block-causal bias still
    apply, because the model builds them from ``io.key_columns``. A *refresh* recomputes and stores every
    column ``[0, L)``; it happens on the first call, whenever batch or length change (e.g. CFG switched
    on), and whenever :meth:`wants_refresh` says so. Subclasses only choose spans and refresh points.
    K/V are stored after RoPE, which is applied from absolute position ids, so this equals caching them
    before RoPE and re-rotating at every call.

    Finished rows: when a call runs only some rows of the batch (``call.extras["rows"]``, ascending
    indices into a batch of ``call.extras["full_batch"]`` rows; see :mod:`dlm_engine.core.rows`), the stored
    keys/values of the rows that left are dropped (:meth:`keep_rows`) and the others stay valid: rows never
    come back, so the store shrinks with the active batch and no refresh is needed.
    """

    def __init__(self, config: Any = None):
        if config is None:
            config = type(self).Config()
        n = getattr(config, "refresh_interval", 0)
        if n is None or int(n) < 0:
            raise ConfigError(f"cache.refresh_interval={n} must be >= 0 (0 = refresh only at block starts)")
        super().__init__(config)
        self.begin(None)

    def begin(self, canvas) -> None:
        self.k: dict = {}
        self.v: dict = {}
        self.shape = None            # (full batch, length) the stored rows belong to; None = nothing stored
        self.rows = None             # rows of the full batch held in the store, ascending; None = all of them
        self.held = 0                # number of rows held in the store
        self.since_refresh = 0       # cached calls since the last refresh
        self._span = None            # (a, b, key_end) of the call in flight; None = pass-through

    def end(self, canvas) -> None:
        self.k, self.v, self.shape, self._span, self.rows = {}, {}, None, None, None

    # -- policy (override these) ----------------------------------------------------------------------
    def compute_span(self, call, directive, refresh: bool) -> Tuple[int, int, int]:
        """``(a, b, key_end)``: recompute columns ``[a, b)``, attend to stored keys ``[0, key_end)``.

        ``refresh`` is True when nothing usable is stored or :meth:`wants_refresh` asked for it; the
        default then recomputes everything.
        """
        L = call.input_ids.shape[1]
        return 0, L, L

    def wants_refresh(self, call, directive) -> bool:
        """Refresh at block starts and, with ``refresh_interval = n > 0``, on every ``n``-th call after a
        refresh (``n = 1``: every call, i.e. exact but without savings)."""
        n = int(getattr(self.cfg, "refresh_interval", 0) or 0)
        return bool(directive.block_start) or (n > 0 and self.since_refresh + 1 >= n)

    def on_reset(self) -> None:
        """Called when the stored tensors are (re)started from nothing (first call, shape change)."""

    def after_call(self, call, directive, refresh: bool) -> None:
        """Runs after the model filled ``call.logits`` (e.g. to set ``call.extras['discard_draws']``)."""

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the stored rows at positions ``index`` (rows finished since the last call are dropped).
        Subclasses that keep per-row state of their own extend this."""
        for store in (self.k, self.v):
            for layer, t in store.items():
                store[layer] = t.index_select(0, index)

    # -- hooks ----------------------------------------------------------------------------------------
    @contextmanager
    def forward(self, call):
        d = call.directive
        if d is None:                # the strategy gave no block structure: plain full call
            self._span = None
            yield call
            return
        B, L = call.input_ids.shape
        rows = call.extras.get("rows")
        full = B if rows is None else int(call.extras["full_batch"])
        fresh = self.shape != (full, L) or (rows is None and self.held != B)
        if fresh:
            self.shape, self.since_refresh, self.rows, self.held = (full, L), 0, rows, B
            self.on_reset()
        elif B != self.held:         # some rows finished since the last call: drop their keys/values
            held = self.rows if self.rows is not None else torch.arange(self.held, device=rows.device)
            self.keep_rows(torch.searchsorted(held, rows))
            self.rows, self.held = rows, B
        refresh = fresh or self.wants_refresh(call, d)
        a, b, key_end = self.compute_span(call, d, refresh)
        if call.extras.get("logits_shift") and 0 <= call.logits_range[0] < a:
            # a shifted-logits model (Dream) reads column j from hidden state j - 1: recompute from there
            a = int(call.logits_range[0])
        if fresh and (a, key_end) != (0, b):
            raise RuntimeError(f"cache '{self.name}': the first call must compute every column it attends to")
        call.compute = (a, b)
        call.extras["cache_refresh"] = refresh
        self._span = (a, b, key_end)
        self._cols = torch.arange(key_end, device=call.input_ids.device)
        yield call
        self.since_refresh = 0 if refresh else self.since_refresh + 1
        self.after_call(call, d, refresh)
        self._span = None

    @contextmanager
    def attention(self, layer: int, io):
        if self._span is None:
            yield io
            return
        a, b, key_end = self._span
        io.k = self._write(self.k, layer, io.k, a, b)[:, :, :key_end]
        io.v = self._write(self.v, layer, io.v, a, b)[:, :, :key_end]
        io.key_columns = self._cols
        yield io

    def _write(self, store: dict, layer: int, fresh: torch.Tensor, a: int, b: int) -> torch.Tensor:
        B, H, _, D = fresh.shape
        L = self.shape[1]
        t = store.get(layer)
        if t is None or t.shape != (B, H, L, D) or t.dtype != fresh.dtype or t.device != fresh.device:
            t = store[layer] = torch.empty((B, H, L, D), dtype=fresh.dtype, device=fresh.device)
        t[:, :, a:b] = fresh
        return t
