"""``cache=block_store``: keys/values of completed blocks are stored once and never recomputed.

Driven by ``CacheDirective.store`` (the block buffer hands over blocks that are complete in every
row). The cache keeps a *frozen prefix* ``[0, f)`` of stored columns: the prompt after the first call,
then each handed-over block once its keys/values were computed from its final tokens (in the call of
the step that hands it over). Every call recomputes only ``[f, end)``, where ``end`` is the end of the
query window when later columns cannot influence it (block-causal attention), else the canvas end.
Honoured store requests are reported in ``directive.stored`` so the strategy can emit ``stored``
block events.

With a block-causal model (``attention_mode: block_causal``, blocks aligned with the strategy's) this
is exact: a completed block's keys/values depend only on itself and earlier blocks, which are final.
With a bidirectional model it is an approximation (stored keys/values never see later tokens), like
the prefix cache without refreshes.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlm_engine.errors import ConfigError
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.kvcache import StoredKVCache
from dlm_engine.core.registry import register_cache

SUFFIX_MODES = ("auto", "compute", "skip")


@dataclass
class BlockStoreCacheConfig:
    suffix: str = "auto"     # columns after the query window: auto (skip iff block-causal) | compute | skip


@register_cache("block_store", BlockStoreCacheConfig)
class BlockStoreCache(StoredKVCache):
    needs = caps(Cap.BLOCKS, Cap.BLOCK_HANDOVER)

    def __init__(self, config: BlockStoreCacheConfig = None):
        config = config if config is not None else BlockStoreCacheConfig()
        if config.suffix not in SUFFIX_MODES:
            raise ConfigError(f"cache.suffix='{config.suffix}' (choose {', '.join(SUFFIX_MODES)})")
        super().__init__(config)

    def on_reset(self) -> None:
        self.frozen = 0                       # columns [0, frozen) hold stored, final keys/values

    def wants_refresh(self, call, d) -> bool:
        return False                          # stored blocks are never recomputed

    def compute_span(self, call, d, refresh):
        L = call.input_ids.shape[1]
        mode = self.cfg.suffix
        skip = mode == "skip" or (mode == "auto" and call.attention_mode == "block_causal")
        end = max(d.block[1], self.frozen) if skip else L
        return self.frozen, end, end

    def after_call(self, call, d, refresh):
        a, b = call.compute
        f = max(self.frozen, min(prompt_frozen(call), b))   # the prompt never changes
        for s, e in sorted(d.store):
            if s <= f and f < e <= b:         # contiguous with what is stored, computed in this call
                f = e
                d.stored.append((s, e))
        self.frozen = f


def prompt_frozen(call) -> int:
    """Columns of the prompt whose keys/values are final once computed: the whole prompt, except with blocks
    aligned to an origin of their own (``ForwardCall.block_origin``, LLaDA2): the prompt's last, partial block
    shares its block with the first generated columns and sees them change, so only its full blocks are final."""
    g = call.gen_start
    origin = getattr(call, "block_origin", None)
    if origin is None or call.attention_mode != "block_causal" or not call.block_size:
        return g
    size = int(call.block_size)
    return origin + max(0, (g - origin) // size) * size
