"""Base classes of KV caches. A cache is the model's hooks object (see :mod:`dlm_engine.core.protocol`)
plus ``begin``/``end`` around one decode and ``after_step`` after every step. Concrete caches live in
``cache/`` and register themselves with :func:`dlm_engine.core.registry.register_cache`; what they need
from a strategy and offer to it is stated in ``needs`` / ``offers`` (:mod:`dlm_engine.core.capabilities`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, ClassVar, Dict, Optional, Tuple

import torch

from dlm_engine.core.capabilities import Cap, Caps, caps
from dlm_engine.core.protocol import Columns, ForwardCall, NullHooks
from dlm_engine.core.strategy import coerce_choices
from dlm_engine.errors import ConfigError


class Cache(NullHooks):
    name: ClassVar[str] = ""
    Config: ClassVar[type] = object
    needs: Caps = caps()                                   # what the strategy must offer
    offers: Caps = caps(Cap.BLOCK_LOGITS, Cap.SUFFIX_LOGITS, Cap.WINDOW_LOGITS)   # what the strategy may need
    # ``after_step`` reads FrameDelta.confidence at every window position, not only the committed ones (the loop
    # then ignores StepPlan.masked and tells strategies so: Proposal.all_confidences)
    reads_confidence: ClassVar[bool] = False

    def __init__(self, config: Any = None):
        self.cfg = coerce_choices(config if config is not None else type(self).Config(), "cache")

    def begin(self, canvas) -> None:
        """Forget everything stored for a previous decode."""

    def end(self, canvas) -> None:
        """Release what was stored."""

    def after_step(self, canvas, delta, call: Optional[ForwardCall]) -> None:
        """Called after every step with the pre-step canvas, the step's delta and its model call (None when
        no call ran); caches that choose what to recompute from the step's result override it."""


def keep_layer_rows(index: torch.Tensor, *stores: Dict[int, torch.Tensor]) -> None:
    """Keep the rows ``index`` of every tensor of per-layer stores (``{layer: [rows, ...]}``), in place."""
    for store in stores:
        for layer in list(store):
            store[layer] = store[layer].index_select(0, index)


class RowStore:
    """Which rows of the full batch a cache's per-row tensors (keys/values, cached outputs, ...) hold.

    Finished rows leave the batch for good (:mod:`dlm_engine.core.rows`): the store drops them
    (:meth:`follow` calls ``keep(index)`` with the positions of the rows to keep). Rows that only sit a
    step out (``CallRequest.rows`` a strict subset of ``CallRequest.live``) stay; for such a call
    :attr:`index` holds the positions of the call's rows in the store (None = the call runs every held row).
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.shape = None            # (full batch, length) the stored rows belong to; None = nothing stored
        self.held = None             # rows of the full batch held, ascending; None = all of them
        self.n_held = 0
        self.index: Optional[torch.Tensor] = None

    def follow(self, call: ForwardCall, keep) -> bool:
        """Align with ``call``; returns True when the store starts afresh (new batch or length)."""
        req = call.request
        full = call.batch_size if req.full_batch is None else int(req.full_batch)
        live = req.live                          # None: every row of the full batch is live
        n_live = full if live is None else int(live.numel())
        fresh = self.shape != (full, call.length)
        if fresh:
            self.shape, self.held, self.n_held = (full, call.length), live, n_live
        elif n_live != self.n_held:           # rows finished since the last call: drop them
            keep(torch.searchsorted(self._held(live.device), live))
            self.held, self.n_held = live, n_live
        rows = req.rows
        self.index = (None if rows is None or int(rows.numel()) == self.n_held
                      else torch.searchsorted(self._held(rows.device), rows))
        return fresh

    def _held(self, device) -> torch.Tensor:
        """The held rows, on the device of the row indices they are searched with."""
        return self.held if self.held is not None else torch.arange(self.n_held, device=device)

    def alloc(self, shape, like: torch.Tensor) -> torch.Tensor:
        """A store tensor for every held row (zeros: rows a call does not write are never garbage)."""
        return torch.zeros((self.n_held,) + tuple(shape[1:]), dtype=like.dtype, device=like.device)


class StoredKVCache(Cache):
    """Base of caches that keep every layer's keys/values for all canvas columns.

    Each call computes one column span ``[a, b)`` (chosen by :meth:`compute_span`); in every layer the
    fresh keys/values of that span are written into the stored tensors (in place) and attention runs over
    the stored keys of columns ``[0, key_end)`` (``hooks.keys_values``). The key padding mask and the
    block-causal mask still apply, because the model builds them from the key columns. A *refresh*
    recomputes and stores every column ``[0, L)``; it happens on the first call, whenever batch or length
    change (e.g. CFG switched on), and whenever :meth:`wants_refresh` says so. Subclasses only choose spans
    and refresh points. K/V are stored after RoPE, which is applied from absolute position ids, so this
    equals caching them before RoPE and re-rotating at every call.

    Rows: the stored keys/values of finished rows are dropped; a call that runs only some of the held rows
    writes and reads those rows (:class:`RowStore`).
    """

    needs = caps(Cap.BLOCKS)
    offers = caps(Cap.BLOCK_LOGITS)
    # shifted-logit models (Dream): widen the span to the hidden state the window's first logit reads. A
    # subclass whose compute_span already accounts for the shift sets this False.
    extend_for_shift: bool = True

    def __init__(self, config: Any = None):
        config = config if config is not None else type(self).Config()
        n = getattr(config, "refresh_interval", 0)
        if n is None or int(n) < 0:
            raise ConfigError(f"cache.refresh_interval={n} must be >= 0 (0 = refresh only at block starts)")
        super().__init__(config)
        self.begin(None)

    def begin(self, canvas) -> None:
        self.k: dict = {}
        self.v: dict = {}
        self.store = RowStore()
        self.since_refresh = 0       # cached calls since the last refresh
        self._span = None            # (a, b, key_end) of the call in flight; None = pass-through
        self._rows_mask = None       # [rows, L] bool: columns each row writes fresh (per-row blocks); None = all

    def end(self, canvas) -> None:
        self.k, self.v, self._span = {}, {}, None
        self.store.reset()

    # -- policy (override these) ----------------------------------------------------------------------
    def compute_span(self, call: ForwardCall, directive, refresh: bool) -> Tuple[int, int, int]:
        """``(a, b, key_end)``: recompute columns ``[a, b)``, attend to stored keys ``[0, key_end)``.

        ``refresh`` is True when nothing usable is stored or :meth:`wants_refresh` asked for it; the
        default then recomputes everything.
        """
        L = call.length
        return 0, L, L

    def wants_refresh(self, call: ForwardCall, directive) -> bool:
        """Refresh at block starts and, with ``refresh_interval = n > 0``, on every ``n``-th call after a
        refresh (``n = 1``: every call, i.e. exact but without savings)."""
        n = int(getattr(self.cfg, "refresh_interval", 0) or 0)
        return bool(directive.block_start) or (n > 0 and self.since_refresh + 1 >= n)

    def row_columns(self, call: ForwardCall, directive, fresh: bool):
        """For a directive with per-row blocks (``CacheDirective.row_blocks``): ``(a, b, key_end, refresh,
        mask)``, the call's span, whether every row refreshes, and a ``[rows of the call, L]`` bool tensor of the
        columns each row writes fresh (the others keep their stored keys/values in this call). None (the
        default): the cache treats every row alike, by ``block``/``block_start``."""
        return None

    def on_reset(self) -> None:
        """Called when the stored tensors are (re)started from nothing (first call, shape change)."""

    def after_call(self, call: ForwardCall, directive, refresh: bool) -> None:
        """Runs after the model filled ``call.logits`` (e.g. to set ``call.discard_draws``)."""

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the stored rows at positions ``index`` (rows finished since the last call are dropped).
        Subclasses that keep per-row state of their own extend this."""
        keep_layer_rows(index, self.k, self.v)

    # -- hooks ----------------------------------------------------------------------------------------
    @contextmanager
    def forward(self, call: ForwardCall):
        d = call.directive
        if d is None:                # the strategy gave no block structure: plain full call
            self._span = None
            yield call
            return
        fresh = self.store.follow(call, self.keep_rows)
        if fresh:
            self.since_refresh = 0
            self.on_reset()
        per_row = self.row_columns(call, d, fresh) if d.row_blocks is not None else None
        if per_row is None:
            refresh = fresh or self.wants_refresh(call, d)
            a, b, key_end = self.compute_span(call, d, refresh)
            self._rows_mask = None
        else:
            a, b, key_end, refresh, self._rows_mask = per_row
        if self.extend_for_shift and call.logits_shift and 0 <= call.logits_range[0] - call.logits_shift < a:
            # a shifted-logits model (Dream) reads column j from hidden state j - 1: recompute from there
            a = int(call.logits_range[0]) - call.logits_shift
        if fresh and (a, key_end) != (0, b):
            raise RuntimeError(f"cache '{self.name}': the first call must compute every column it attends to")
        call.columns = Columns.span(a, b)
        call.refreshed = refresh
        self._span = (a, b, key_end)
        self._cols = torch.arange(key_end, device=call.input_ids.device)
        yield call
        self.since_refresh = 0 if refresh else self.since_refresh + 1
        self.after_call(call, d, refresh)
        self._span = self._rows_mask = None

    def keys_values(self, layer: int, io, k: torch.Tensor, v: torch.Tensor):
        if self._span is None or io.query_cols is not None:
            return k, v, None
        a, b, key_end = self._span
        kk = self._write(self.k, layer, k, a, b)[:, :, :key_end]
        vv = self._write(self.v, layer, v, a, b)[:, :, :key_end]
        return kk, vv, self._cols

    def _write(self, store: dict, layer: int, fresh: torch.Tensor, a: int, b: int) -> torch.Tensor:
        _, H, _, D = fresh.shape
        rs = self.store
        t = store.get(layer)
        if t is None or t.shape != (rs.n_held, H, rs.shape[1], D) or t.dtype != fresh.dtype or t.device != fresh.device:
            t = store[layer] = rs.alloc((0, H, rs.shape[1], D), fresh)
        if self._rows_mask is not None:    # per-row blocks: a row keeps its stored keys/values outside its own span
            old = t[:, :, a:b] if rs.index is None else t[rs.index, :, a:b]
            fresh = torch.where(self._rows_mask[:, None, a:b, None], fresh, old)
        if rs.index is None:
            t[:, :, a:b] = fresh
            return t
        t[rs.index, :, a:b] = fresh
        return t[rs.index]
