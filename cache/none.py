"""``cache=none``: every step recomputes every column (the reference behaviour)."""
from dataclasses import dataclass

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.kvcache import Cache
from dlm_engine.core.registry import register_cache


@dataclass
class NoCacheConfig:
    """No options: the registry adds ``name``."""


@register_cache("none", NoCacheConfig)
class NoCache(Cache):
    """Stores nothing; all logits of every call are valid, auxiliary columns work."""

    offers = caps(Cap.BLOCK_LOGITS, Cap.SUFFIX_LOGITS, Cap.WINDOW_LOGITS, Cap.AUX_COLUMNS)
