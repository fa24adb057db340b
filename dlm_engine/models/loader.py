"""Loading official-format checkpoint directories safely (safetensors only, no remote code)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Tuple

import torch

from ..errors import UserError
from .base import register_auto

def architecture(model_type: str) -> Tuple[type, type]:
    """``(config class, model class)`` of a ``config.json`` ``model_type`` (registered with transformers' Auto
    classes on the way)."""
    from .base import MODELS

    try:
        cls = MODELS.get(model_type)
    except UserError:
        raise UserError(f"unsupported model_type '{model_type}' (supported: {', '.join(MODELS.names())})") from None
    register_auto(model_type, cls.config_class, cls)
    return cls.config_class, cls


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype in ("auto", None, ""):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise UserError(f"dtype: unknown value '{dtype}' (use auto, float32, bfloat16 or float16)")
    return table[dtype]


def resolve_device(device: str) -> torch.device:
    if device in ("auto", None, ""):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise UserError(f"device: invalid value '{device}' ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device: '{device}' requested but CUDA is not available (use device=cpu or device=auto)")
    return dev


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise UserError(f"model.path: checkpoint directory '{path}' does not exist")
    if not cfg_file.is_file():
        raise UserError(f"model.path: '{path}' has no config.json (not a checkpoint directory)")
    try:
        with open(cfg_file) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"model.path: '{cfg_file}' is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"model.path: '{cfg_file}' has no model_type")
    return data


def weight_files(path: Path) -> list:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"model.path: '{index}' is malformed ({exc})") from None
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise UserError(f"model.path: '{path}' holds only pickle weights (*.bin/*.pt); dlm_engine loads safetensors only")
        raise UserError(f"model.path: '{path}' has no *.safetensors weights")
    for f in files:
        if not f.is_file():
            raise UserError(f"model.path: weight file '{f}' listed in the index is missing")
    return files


def weights_digest(files) -> str:
    """SHA-256 over the weight files (full content below 512 MB, else each file's safetensors header + size)."""
    total = sum(os.path.getsize(f) for f in files)
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).name.encode())
        with open(f, "rb") as fh:
            if total <= (512 << 20):
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            else:
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(n, 100 << 20)))
                h.update(str(os.path.getsize(f)).encode())
    return "sha256:" + h.hexdigest()


def load_pretrained(path, device: str = "cpu", dtype: str = "float32"):
    """Load an official-format directory; returns (model, config dict, weights digest)."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    raw = read_config(path)
    config_cls, model_cls = architecture(raw["model_type"])
    files = weight_files(path)
    dev = resolve_device(device)
    tdtype = resolve_dtype(dtype, dev)
    try:
        config = config_cls(**{k: v for k, v in raw.items() if k not in ("model_type",)})
    except (TypeError, ValueError) as exc:
        raise UserError(f"model.path: '{path / 'config.json'}' is malformed ({exc})") from None
    state = {}
    for f in files:  # shard by shard, straight to the device and dtype: the host never holds every shard at once
        try:
            shard = load_file(str(f), device=str(dev))
        except Exception as exc:
            raise UserError(f"model.path: cannot read '{f}' ({exc})") from None
        for k, v in shard.items():
            state[k] = v.to(tdtype) if v.is_floating_point() else v
        del shard
    with torch.device("meta"):
        model = model_cls(config)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        detail = (f"missing {missing[:3]}" if missing else "") + (f" unexpected {unexpected[:3]}" if unexpected else "")
        raise UserError(f"model.path: weights in '{path}' do not match the {raw['model_type']} architecture ({detail.strip()})")
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        raise UserError(f"model.path: weights in '{path}' have wrong shapes ({first[-1].strip() if first else exc})") from None
    model.to(dev).eval()
    return model, raw, weights_digest(files)


def build_random(config: dict, seed: int = 0, device: str = "cpu", dtype: str = "float32"):
    """A seeded random model from a config dict (no files needed)."""
    raw = dict(config)
    model_type = raw.pop("model_type", "llada")
    config_cls, model_cls = architecture(model_type)
    dev = resolve_device(device)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_cls(config_cls(**raw))
    finally:
        torch.random.set_rng_state(gen_state)
    model.to(device=dev, dtype=resolve_dtype(dtype, dev)).eval()
    h = hashlib.sha256(json.dumps({"config": config, "seed": seed}, sort_keys=True).encode())
    return model, dict(config, model_type=model_type), "random:" + h.hexdigest()[:16]
