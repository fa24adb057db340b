"""Base class of KV caches. A cache is the model's hooks object (see :mod:`dlm_engine.models.hooks`)
plus ``begin``/``end`` around one decode. Concrete caches live in ``cache/`` and register themselves
with :func:`dlm_engine.registry.register_cache`.
"""
from __future__ import annotations

from typing import Any, ClassVar

from .models.hooks import NullHooks


class Cache(NullHooks):
    name: ClassVar[str] = ""
    Config: ClassVar[type] = object

    def __init__(self, config: Any = None):
        self.cfg = config

    def begin(self, canvas) -> None:
        """Forget everything stored for a previous decode."""

    def end(self, canvas) -> None:
        """Release what was stored."""
