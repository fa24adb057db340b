"""The bundled model families; importing this module registers them (``dlm_engine.models.base.MODELS``)."""
from dlm_engine.models import dream, llada, llada2, qwen_bd  # noqa: F401
from dlm_engine.models.base import MODELS  # noqa: F401  (the registry, with every family above in it)
