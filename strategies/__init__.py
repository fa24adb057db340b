"""Bundled decoding strategies (installed as ``dlm_engine.strategies``).

Every module here is imported on package import; each registers itself with
``@register_strategy``. Adding a strategy = one module here + one YAML in ``conf/strategy/``.
"""
import importlib as _importlib
import pkgutil as _pkgutil

for _m in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _m.name.startswith("_"):
        _importlib.import_module(f"{__name__}.{_m.name}")
