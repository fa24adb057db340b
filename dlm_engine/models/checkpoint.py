"""Checks of a ``model`` config node against its checkpoint directory, before anything is loaded.

Presets (``conf/model/llada_8b_instruct.yaml`` ...) carry the official repository id and the expected
``model_type``; every error is one line naming the path tried and how to set it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..errors import UserError
from .loader import check_tokenizer_config, read_config, weight_files


def how_to_set(model_cfg) -> str:
    hub = getattr(model_cfg, "hub_id", None)
    if hub:
        return (f"set model.path=DIR to a local copy of {hub} (config.json + *.safetensors, or its Hugging Face "
                "cache folder models--ORG--NAME)")
    return "set model.path=DIR to an official-format checkpoint directory (config.json + *.safetensors)"


def hub_cache_repo(hub_id: str) -> Path:
    """Where the Hugging Face hub keeps ``hub_id`` locally (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``), read at call time."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
        cache = os.path.join(home, "hub")
    return Path(cache).expanduser() / ("models--" + hub_id.replace("/", "--"))


def snapshot_of(repo_dir: Path) -> Optional[Path]:
    """The snapshot a Hugging Face cache folder (``models--ORG--NAME``) points at: ``refs/main``, else the
    newest snapshot; None when ``repo_dir`` is not such a folder."""
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text().strip()
        if pinned.is_dir():
            return pinned
    found = [d for d in snapshots.iterdir() if d.is_dir()]
    return max(found, key=lambda d: d.stat().st_mtime) if found else None


def check_checkpoint(model_cfg) -> Optional[Path]:
    """The checkpoint directory of ``model_cfg`` (None for seeded random models); raises UserError.

    ``model.path`` may be a checkpoint directory or a Hugging Face cache folder (``models--ORG--NAME``, its
    snapshot is used). Unset, a preset with a ``hub_id`` is looked up in the local Hugging Face cache
    (no network)."""
    path = getattr(model_cfg, "path", None)
    name = getattr(model_cfg, "name", "?")
    if not path:
        if getattr(model_cfg, "random", None):
            return None
        hub = getattr(model_cfg, "hub_id", None)
        if not hub:
            raise UserError(f"model.path is not set for model={name}: {how_to_set(model_cfg)}")
        repo = hub_cache_repo(str(hub))
        p = snapshot_of(repo)
        if p is None:
            raise UserError(f"model.path is not set for model={name} and {hub} is not in the local Hugging Face "
                            f"cache (looked in '{repo}'): {how_to_set(model_cfg)}")
    else:
        p = Path(str(path)).expanduser()
        if not (p / "config.json").exists():
            p = snapshot_of(p) or p
    try:
        raw = read_config(p)
        weight_files(p)
        check_tokenizer_config(p)
    except UserError as exc:
        raise UserError(f"{exc}; model={name}: {how_to_set(model_cfg)}") from None
    expected = getattr(model_cfg, "model_type", None)
    if expected and raw["model_type"] != expected:
        raise UserError(f"model.path: '{p}' holds a '{raw['model_type']}' checkpoint but model={name} expects "
                        f"model_type '{expected}' (model=local accepts any supported architecture)")
    return p
