"""What every model family shares: the mixin on top of ``PreTrainedModel``, registration with transformers'
Auto classes (our own code, never remote code) and the registry of families by ``config.json``
``model_type``. A family module decorates its model class with ``@register_model("<model_type>")`` and is
listed in :mod:`dlm_engine.models.families`, whose ``MODELS`` is the registry with every bundled family."""
from __future__ import annotations

import torch.nn as nn

from dlm_engine.core.registry import Registry
from dlm_engine.models.layers import RMSNorm


class DiffusionLMMixin:
    """What LLaDA and Dream share on top of ``PreTrainedModel``: random initialisation (only random models
    use it: tests, training from scratch) and the mask id the decoding loop needs."""

    init_std: float = 0.02

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.normal_(module.bias, std=self.init_std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    @property
    def mask_token_id(self) -> int:
        return int(self.config.mask_token_id)


def register_auto(model_type: str, config_cls, model_cls) -> None:
    """Make ``AutoConfig``/``AutoModel``/``AutoModelForMaskedLM`` resolve ``model_type`` to our own code
    (never remote code); registering twice is harmless."""
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

    try:
        AutoConfig.register(model_type, config_cls)
    except ValueError:
        pass
    for auto in (AutoModel, AutoModelForMaskedLM):
        try:
            auto.register(config_cls, model_cls)
        except ValueError:
            pass


# filled by the family modules' decorators; :mod:`dlm_engine.models.families` imports every bundled family and is
# the module to read it from (this one imports no family: a family imports it)
MODELS = Registry("model family", DiffusionLMMixin)
register_model = MODELS.register
