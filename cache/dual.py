"""``cache=dual``: Fast-dLLM's dual cache.

At a block start (``directive.block_start``) the whole canvas is run and every layer's keys/values are
stored for all ``L`` columns. On cached steps only the block ``[s, e)`` is fed through the model; its
fresh keys/values overwrite rows ``[s, e)`` of the stored ones in place, while the prefix **and** the
suffix keep the keys/values of the block-start call.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlm_engine.core.kvcache import StoredKVCache
from dlm_engine.core.registry import register_cache


@dataclass
class DualCacheConfig:
    name: str = "dual"
    refresh_interval: int = 0    # also refresh every n-th step of a block (0 = only at block starts)


@register_cache("dual", DualCacheConfig)
class DualCache(StoredKVCache):
    def compute_span(self, call, d, refresh):
        L = call.input_ids.shape[1]
        return (0, L, L) if refresh else (d.block[0], d.block[1], L)
