"""One registry type for strategies, caches and model families.

``@register_strategy("name", Config)`` records the class under ``name`` and stores its dataclass config in
Hydra's ConfigStore as ``schema/strategy/<name>``; ``conf/strategy/<name>.yaml`` extends that schema
(``- /schema/strategy/<name>@_here_``), so the dataclass stays the one source of defaults and unknown keys
or wrong types fail in Hydra. Schemas live in their own ``schema/`` group, so they are never offered as a
``strategy=`` / ``cache=`` option. Caches work the same way; model families register with a
:class:`Registry` of their own (``dlm_engine.models.base.MODELS``, no Hydra schema: the ``model`` group
describes a checkpoint, not an architecture).

Plug-ins are imported by :func:`load_plugins`: the bundled ``dlm_engine.strategies`` and
``dlm_engine.cache`` packages, the ``dlm_engine.plugins`` entry-point group, and the modules listed in
``$DLM_ENGINE_PLUGINS`` (comma-separated).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import threading
from dataclasses import is_dataclass
from typing import Callable, Dict, Iterator, List, Optional

from dlm_engine.errors import UserError

SCHEMA_GROUP = "schema"


class Registry:
    """Named classes of one kind. ``base`` (a class or a zero-argument function returning one, so the core
    need not import model code) is what every registered class must subclass; ``group`` is the Hydra config
    group whose schemas go to ``schema/<group>`` (None = no schema)."""

    def __init__(self, kind: str, base, group: Optional[str] = None, loader: Optional[Callable[[], None]] = None):
        self.kind, self._base, self.group, self._loader = kind, base, group, loader
        self._classes: Dict[str, type] = {}

    @property
    def base(self) -> type:
        return self._base() if not isinstance(self._base, type) else self._base

    def register(self, name: str, config: Optional[type] = None) -> Callable[[type], type]:
        """Class decorator: register under ``name`` (with its dataclass ``config`` when the kind has a group)."""
        def deco(cls: type) -> type:
            if not isinstance(cls, type) or not issubclass(cls, self.base):
                raise TypeError(f"{self.kind} '{name}': {cls!r} must subclass {self.base.__module__}.{self.base.__name__}")
            old = self._classes.get(name)
            if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ValueError(f"{self.kind} '{name}' is already registered by {old.__module__}.{old.__qualname__}")
            if self.group is not None:
                if config is None or not is_dataclass(config):
                    raise TypeError(f"{self.kind} '{name}': config must be a dataclass")
                named = named_config(config, name)
                from hydra.core.config_store import ConfigStore

                ConfigStore.instance().store(group=f"{SCHEMA_GROUP}/{self.group}", name=name, node=named)
                cls.Config = named
            cls.name = name
            self._classes[name] = cls
            return cls

        return deco

    def unregister(self, name: str) -> None:
        """Forget ``name`` (tests that register throw-away classes)."""
        self._classes.pop(name, None)
        if self.group is not None:
            from hydra.core.config_store import ConfigStore

            ConfigStore.instance().repo.get(SCHEMA_GROUP, {}).get(self.group, {}).pop(f"{name}.yaml", None)

    def get(self, name: str) -> type:
        if self._loader is not None:
            self._loader()
        if name not in self._classes:
            raise UserError(f"{self.group or self.kind}: unknown {self.kind} '{name}' "
                            f"(registered: {', '.join(sorted(self._classes))})")
        return self._classes[name]

    def names(self) -> List[str]:
        if self._loader is not None:
            self._loader()
        return sorted(self._classes)

    def items(self):
        return [(n, self._classes[n]) for n in self.names()]

    def __contains__(self, name: str) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __getitem__(self, name: str) -> type:
        return self._classes[name]


def named_config(config: type, name: str) -> type:
    """``config`` with a ``name`` field (its first own field) whose default is the registered ``name``: the
    registry gives each config its name, so a strategy or cache writes it once, in its decorator. A dataclass
    that declares ``name`` itself keeps it (``tests/test_config_presets.py`` finds those)."""
    own = dict(config.__dict__.get("__annotations__", {}))
    if "name" in own:
        return config
    params = config.__dataclass_params__
    for f in dataclasses.fields(config):          # the dataclass pass re-reads its own fields from the class
        if f.name in own:
            setattr(config, f.name, f)
    for attr in ("__init__", "__repr__", "__eq__", "__setattr__", "__delattr__", "__hash__", "__match_args__"):
        if attr in config.__dict__:           # generated by the first pass; a second pass never replaces them
            delattr(config, attr)
    config.__annotations__ = {"name": "str", **own}
    config.name = name
    config = dataclasses.dataclass(config, init=params.init, repr=params.repr, eq=params.eq, order=params.order,
                                   unsafe_hash=params.unsafe_hash, frozen=params.frozen)
    config.__registry_named__ = name
    return config


def _strategy_base():
    from dlm_engine.core.strategy import Strategy

    return Strategy


def _cache_base():
    from dlm_engine.core.kvcache import Cache

    return Cache


STRATEGIES = Registry("strategy", _strategy_base, group="strategy", loader=lambda: load_plugins())
CACHES = Registry("cache", _cache_base, group="cache", loader=lambda: load_plugins())

register_strategy = STRATEGIES.register
register_cache = CACHES.register


def strategy_class(name: str) -> type:
    return STRATEGIES.get(name)


def cache_class(name: str) -> type:
    return CACHES.get(name)


_loaded = False
_loading = False
_load_lock = threading.RLock()


def load_plugins() -> None:
    """Import bundled and third-party plug-ins once (they register themselves on import).

    Thread safe: a second thread waits until the first has imported everything (the "done" flag is set after the
    work, not before: a thread that saw it early looked up an empty registry, ``unknown cache 'none'``). A plug-in
    whose import calls back in, on the loading thread, returns at once, as before."""
    global _loaded, _loading
    if _loaded:
        return
    with _load_lock:
        if _loaded or _loading:
            return
        _loading = True
        try:
            _import_plugins()
            _loaded = True
        finally:
            _loading = False


def _import_plugins() -> None:
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
