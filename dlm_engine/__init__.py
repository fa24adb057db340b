"""dlm_engine: decoding strategies for diffusion language models, with one step loop and a trace recorder."""
import os as _os

# OpenMP spin-waiting makes torch ~20x slower on small shared machines; must be set before torch loads.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"

try:  # OmegaConf resolvers of conf/ (also needed in Hydra launcher workers, which import this package)
    from dlm_engine.app.config import register_resolvers as _register_resolvers

    _register_resolvers()
except ImportError:  # pragma: no cover - omegaconf missing: only the Hydra app needs the resolvers
    pass


__all__ = ["generate", "Session", "Results"]


def __getattr__(name):
    """The Python API -- ``dlm_engine.generate``, ``dlm_engine.Session`` and their ``Results`` -- imported on first
    use: ``import dlm_engine`` itself stays light (no torch) for the trace tools. This is the one public Python
    module; its defaults are ``dlm``'s (``dlm_engine.app.session``). ``dlm_engine.app.api`` is the engine under
    it (and under ``dlm`` and ``dlm-serve``): model loading and batched decoding without Hydra."""
    if name in __all__:
        from dlm_engine.app import session

        return getattr(session, name)
    raise AttributeError(f"module 'dlm_engine' has no attribute '{name}'")
