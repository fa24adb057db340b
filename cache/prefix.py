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

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.kvcache import StoredKVCache
from dlm_engine.core.registry import register_cache


class Shifted(str, Enum):
    """How a span cache queries a shifted-logit model (Dream)."""

    extend = "extend"     # also recompute the column before the span (Fast-dLLM)
    move = "move"         # recompute the span moved left by the shift (d2Cache's PrefixCache)


@dataclass
class PrefixCacheConfig:
    name: str = "prefix"
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


@register_cache("prefix", PrefixCacheConfig)
class PrefixCache(SpanCache):
    offers = caps(Cap.BLOCK_LOGITS, Cap.SUFFIX_LOGITS)

    def cached_span(self, call, d):
        return d.block[0], call.input_ids.shape[1]

    def after_call(self, call, d, refresh):
        if not refresh and self.cfg.wasted_draw:
            call.discard_draws = 1
