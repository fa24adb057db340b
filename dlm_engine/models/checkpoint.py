"""Checks of a ``model`` config node against its checkpoint directory, before anything is loaded.

Presets (``conf/model/llada_8b_instruct.yaml`` ...) carry the official repository id and the expected
``model_type``; every error is one line naming the path tried and how to set it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import UserError
from .loader import read_config, weight_files


def how_to_set(model_cfg) -> str:
    hub = getattr(model_cfg, "hub_id", None)
    if hub:
        return (f"set model.path=DIR to a local copy of {hub} (config.json + *.safetensors, e.g. a Hugging Face "
                "cache snapshot directory)")
    return "set model.path=DIR to an official-format checkpoint directory (config.json + *.safetensors)"


def check_checkpoint(model_cfg) -> Optional[Path]:
    """The checkpoint directory of ``model_cfg`` (None for seeded random models); raises UserError."""
    path = getattr(model_cfg, "path", None)
    name = getattr(model_cfg, "name", "?")
    if not path:
        if getattr(model_cfg, "random", None):
            return None
        raise UserError(f"model.path is not set for model={name}: {how_to_set(model_cfg)}")
    p = Path(str(path)).expanduser()
    try:
        raw = read_config(p)
        weight_files(p)
    except UserError as exc:
        raise UserError(f"{exc}; model={name}: {how_to_set(model_cfg)}") from None
    expected = getattr(model_cfg, "model_type", None)
    if expected and raw["model_type"] != expected:
        raise UserError(f"model.path: '{p}' holds a '{raw['model_type']}' checkpoint but model={name} expects "
                        f"model_type '{expected}' (model=local accepts any supported architecture)")
    return p
