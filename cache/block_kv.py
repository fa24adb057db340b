"""``cache=block_kv``: the block KV store of the block-diffusion references (Fast-dLLM v2, SDAR).

Every layer's rotated keys/values are kept per canvas column. A call computes only the columns its directive
names -- the working block (``CacheDirective.block``) or part of it (``CacheDirective.query``: Fast-dLLM v2's
sub-block query) -- and attends to the stored keys of ``[key_start, block end)``: the stored prefix, the
block's own fresh keys and, for a sub-block query, the slots of the block that an earlier call of the block
wrote (Fast-dLLM v2's *block cache*, stale by design: it is what its ``use_block_cache`` attends). A call whose
directive asks to ``store`` ranges (the prefill of the prompt's full blocks, the store forward of a finished
block) makes them final: later calls never recompute them. Store requests honoured are reported in
``directive.stored``.

Exact for block-causal models whose blocks are aligned with the strategy's (what the references do: a block's
keys depend on itself and earlier blocks only). The model learns the mask's block size from
``CacheDirective.attention_block``. Without a directive (a strategy that names no block) every call computes
everything, as ``cache=none``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.kvcache import Cache, RowStore, StoredKVCache, keep_layer_rows
from dlm_engine.core.protocol import Columns, ForwardCall
from dlm_engine.core.registry import register_cache


@dataclass
class BlockKVCacheConfig:
    """No options: the registry adds ``name``."""


@register_cache("block_kv", BlockKVCacheConfig)
class BlockKVCache(Cache):
    """Not a :class:`StoredKVCache` (whose calls may start from nothing stored and equal a full call with any
    model): only the strategies' prefill and store forwards put columns in this store, and it is exact only with
    block-causal models."""

    needs = caps(Cap.BLOCKS, Cap.BLOCK_HANDOVER, Cap.STORE_FORWARDS)
    offers = caps(Cap.BLOCK_LOGITS, Cap.BLOCK_KV)

    def __init__(self, config: BlockKVCacheConfig = None):
        super().__init__(config)
        self.begin(None)

    def begin(self, canvas) -> None:
        self.k: dict = {}
        self.v: dict = {}
        self.store = RowStore()
        self._span = None
        self._rows_mask = None       # every row writes its whole span (StoredKVCache._write's per-row mask: unused)
        self.on_reset()

    def end(self, canvas) -> None:
        self.k, self.v, self._span = {}, {}, None
        self.store.reset()

    def keep_rows(self, index: torch.Tensor) -> None:
        keep_layer_rows(index, self.k, self.v)

    def on_reset(self) -> None:
        self.frozen = 0        # columns [0, frozen) hold stored, final keys/values
        self.written = 0       # columns [0, written) hold keys/values of some call (the block cache included)

    _write = StoredKVCache._write      # (write a call's fresh keys/values into the per-column store)

    @contextmanager
    def forward(self, call: ForwardCall):
        d = call.directive
        if d is None:
            self._span = None
            yield call
            return
        if self.store.follow(call, self.keep_rows):
            self.on_reset()
        s, e = d.block
        a, b = d.query if d.query is not None else (s, e)
        ks = int(d.key_start)
        if a > max(self.written, ks):
            raise RuntimeError(f"cache 'block_kv': columns [{max(self.written, ks)}, {a}) were never computed "
                               f"(call for [{a}, {b}))")
        key_end = max(b, e) if d.query is not None else b
        if key_end > max(self.written, b):
            raise RuntimeError(f"cache 'block_kv': a sub-block query of [{a}, {b}) needs the block's keys up to "
                               f"{key_end}, which no earlier call of the block computed")
        call.columns = Columns.span(a, b)
        self._span = (a, b, key_end)
        self._cols = torch.arange(ks, key_end, device=call.input_ids.device)
        self._ks = ks
        yield call
        self.written = max(self.written, b)
        for rs, re in sorted(d.store):          # computed by this call and contiguous with what is stored
            if a <= rs and re <= b and rs <= max(self.frozen, ks):
                self.frozen = max(self.frozen, re)
                d.stored.append((rs, re))
        self._span = None

    def keys_values(self, layer: int, io, k: torch.Tensor, v: torch.Tensor):
        if self._span is None or io.query_cols is not None:
            return k, v, None
        a, b, key_end = self._span
        ks = self._ks
        kk = self._write(self.k, layer, k, a, b)[:, :, ks:key_end]
        vv = self._write(self.v, layer, v, a, b)[:, :, ks:key_end]
        return kk, vv, self._cols
