"""``cache=prefix``: Fast-dLLM's prefix cache.

At a block start (``directive.block_start``) the whole canvas is run and every layer's keys/values are
stored. On the following (cached) steps only the columns ``[s, L)`` — the current block and everything
after it — are recomputed; the keys/values of the prefix ``[0, s)`` stay those of the block-start call.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.kvcache import StoredKVCache
from dlm_engine.core.registry import register_cache


@dataclass
class PrefixCacheConfig:
    name: str = "prefix"
    refresh_interval: int = 0    # also refresh every n-th step of a block (0 = only at block starts)
    wasted_draw: bool = True     # Fast-dLLM's discarded Gumbel draw on cached steps at T > 0 (RNG parity)


@register_cache("prefix", PrefixCacheConfig)
class PrefixCache(StoredKVCache):
    offers = caps(Cap.BLOCK_LOGITS, Cap.SUFFIX_LOGITS)

    def compute_span(self, call, d, refresh):
        L = call.input_ids.shape[1]
        return (0 if refresh else d.block[0]), L, L

    def after_call(self, call, d, refresh):
        if not refresh and self.cfg.wasted_draw:
            call.discard_draws = 1
