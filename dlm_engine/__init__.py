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
