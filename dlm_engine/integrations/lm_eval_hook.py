"""Start-up hook that lets lm-eval's own command line find ``--model dlm_engine``.

lm-eval 0.4 resolves ``--model NAME`` in its model registry and has no plug-in discovery, so a model of
another package is unknown unless that package was imported first. The install therefore ships this file
as the top-level module ``dlm_engine_lm_eval_hook`` plus a one-line ``dlm_engine_lm_eval.pth`` that calls
:func:`install` at interpreter start-up (see ``setup.py``).

:func:`install` only puts a watcher on ``sys.meta_path``: nothing is imported, and every other import pays
one string comparison. When ``lm_eval.api.registry`` is imported, the watcher lets it load normally and
then adds the lazy entries ``dlm_engine`` / ``dlm-engine`` -> ``dlm_engine.integrations.lm_eval:DLMEngineLM``; dlm_engine
itself (and torch) load only when lm-eval asks for that model. Set ``DLM_ENGINE_LM_EVAL_HOOK=0`` to turn
the hook off. This file must stay free of dlm_engine imports: it runs in every interpreter of the
environment.
"""
import os
import sys

REGISTRY_MODULE = "lm_eval.api.registry"
ENTRY = "dlm_engine.integrations.lm_eval:DLMEngineLM"
ALIASES = ("dlm_engine", "dlm-engine")
OFF_SWITCH = "DLM_ENGINE_LM_EVAL_HOOK"


def register(registry_module) -> None:
    """Add the lazy model entries to a freshly loaded ``lm_eval.api.registry``."""
    # get_model() imports lm-eval's built-in model names only into an empty registry, so they go in first.
    import lm_eval.models  # noqa: F401

    models = registry_module.model_registry
    for alias in ALIASES:
        if alias not in models:
            models.register(alias, target=ENTRY)


class RegistryWatcher:
    """Meta-path finder that answers only for lm-eval's registry module, and only to run :func:`register`
    right after that module's own code."""

    dlm_engine_lm_eval_hook = True  # marker: the package copy and the top-level copy are different classes

    def find_spec(self, name, path=None, target=None):
        if name != REGISTRY_MODULE:
            return None
        spec = None
        for finder in sys.meta_path:  # the finders after us locate the real module
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        load = loader.exec_module  # loaders are per-module objects: patching this one touches nothing else

        def exec_module(module):
            load(module)
            try:
                register(module)
            except Exception as exc:  # never break lm-eval itself (e.g. a registry API this hook predates)
                import warnings

                warnings.warn(f"dlm_engine: could not register '--model dlm_engine' with lm-eval ({exc}); "
                              f"use 'dlm-lm-eval' instead", RuntimeWarning, stacklevel=2)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Put the watcher first on ``sys.meta_path`` (once; a no-op when turned off)."""
    if os.environ.get(OFF_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    if REGISTRY_MODULE in sys.modules:  # lm-eval is already loaded: register now
        register(sys.modules[REGISTRY_MODULE])
        return
    if not any(getattr(f, "dlm_engine_lm_eval_hook", False) for f in sys.meta_path):
        sys.meta_path.insert(0, RegistryWatcher())
