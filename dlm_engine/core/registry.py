"""Registries for strategies and caches.

``@register_strategy("name", Config)`` records the class and stores its dataclass config in Hydra's
ConfigStore as ``strategy/<name>_schema``; ``conf/strategy/<name>.yaml`` extends that schema, so the
dataclass stays the one source of defaults and unknown keys or wrong types fail in Hydra.
Plug-ins are imported by :func:`load_plugins`: the bundled ``dlm_engine.strategies`` and
``dlm_engine.cache`` packages, the ``dlm_engine.plugins`` entry-point group, and the modules listed
in ``$DLM_ENGINE_PLUGINS`` (comma-separated).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import is_dataclass
from typing import Callable, Dict

from dlm_engine.errors import UserError

STRATEGIES: Dict[str, type] = {}
CACHES: Dict[str, type] = {}


def _store(group: str, name: str, config: type) -> None:
    from hydra.core.config_store import ConfigStore

    if not is_dataclass(config):
        raise TypeError(f"{group} '{name}': config must be a dataclass")
    ConfigStore.instance().store(group=group, name=f"{name}_schema", node=config)


def register_strategy(name: str, config: type) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        cls.name = name
        cls.Config = config
        STRATEGIES[name] = cls
        _store("strategy", name, config)
        return cls

    return deco


def register_cache(name: str, config: type) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        cls.name = name
        cls.Config = config
        CACHES[name] = cls
        _store("cache", name, config)
        return cls

    return deco


def _lookup(table: Dict[str, type], kind: str, name: str) -> type:
    load_plugins()
    if name not in table:
        raise UserError(f"{kind}.name: unknown {kind} '{name}' (registered: {', '.join(sorted(table))})")
    return table[name]


def strategy_class(name: str) -> type:
    return _lookup(STRATEGIES, "strategy", name)


def cache_class(name: str) -> type:
    return _lookup(CACHES, "cache", name)


_loaded = False


def load_plugins() -> None:
    """Import bundled and third-party plug-ins once (they register themselves on import)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in ("dlm_engine.strategies", "dlm_engine.cache"):
        importlib.import_module(mod)
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group="dlm_engine.plugins"):
            ep.load()
    except Exception as exc:  # a broken third-party plug-in must not hide the bundled ones
        raise UserError(f"plug-in entry point failed to load: {exc}") from None
    for mod in filter(None, (m.strip() for m in os.environ.get("DLM_ENGINE_PLUGINS", "").split(","))):
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            raise UserError(f"DLM_ENGINE_PLUGINS: cannot import '{mod}' ({exc})") from None
