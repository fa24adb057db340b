"""``cache=dual``: Fast-dLLM's dual cache (and the d2Cache framework's ``PrefixCache(use_dual=True)``).

At a block start (``directive.block_start``) the whole canvas is run and every layer's keys/values are
stored for all ``L`` columns. On cached steps only the block ``[s, e)`` is fed through the model; its
fresh keys/values overwrite rows ``[s, e)`` of the stored ones in place, while the prefix **and** the
suffix keep the keys/values of the block-start call. ``shifted`` chooses how a shifted-logit model (Dream)
is queried (see :mod:`cache.prefix`): ``extend`` recomputes ``[s - 1, e)``, ``move`` ``[s - 1, e - 1)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlm_engine.core.registry import register_cache

from .prefix import Shifted, SpanCache


@dataclass
class DualCacheConfig:
    refresh_interval: int = 0    # also refresh every n-th step of a block (0 = only at block starts)
    shifted: Shifted = Shifted.extend   # shifted-logit models: extend (Fast-dLLM) | move (d2Cache)


@register_cache("dual", DualCacheConfig)
class DualCache(SpanCache):
    def cached_span(self, call, d):
        return d.block

    def row_spans(self, lo, hi, L):
        return lo, hi
