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
    from .families import MODELS

    try:
        cls = MODELS.get(model_type)
    except UserError:
        raise UserError(f"unsupported model_type '{model_type}' (supported: {', '.join(MODELS.names())})") from None
    register_auto(model_type, cls.config_class, cls)
    return cls.config_class, cls


def check_tokenizer_config(path: Path) -> None:
    """``tokenizer_config.json`` may name files (``tokenizer_file``, ``vocab_file``, ...) that transformers
    then opens: each must be a plain file name inside the checkpoint directory."""
    cfg_file = path / "tokenizer_config.json"
    if not cfg_file.is_file():
        return
    try:
        with open(cfg_file) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"model.path: '{cfg_file}' is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(data, dict):
        raise UserError(f"model.path: '{cfg_file}' is not a JSON object")
    for key, v in data.items():
        if key.endswith(("_file", "_files")) and v is not None:
            for name in (v if isinstance(v, list) else [v]):
                _plain_file_name(name, str(cfg_file), key)


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


# config.json fields of the supported architectures: (kind, required). "pos": an integer >= 1, "id": a token
# id (>= 0, checked against the vocabulary below), "real": a finite number > 0 (Dream's initializer range may
# be 0, which "nonneg" allows), "bool", "str". Sizes have generous upper bounds: a typo like 4096000 is caught
# before a model of that size is built.
_DIM, _VOCAB, _LAYERS, _POS = 1 << 17, 1 << 24, 1 << 12, 1 << 24
CONFIG_FIELDS = {
    "llada": {"d_model": ("pos", True, _DIM), "n_heads": ("pos", True, _DIM), "n_kv_heads": ("pos", False, _DIM),
              "n_layers": ("pos", True, _LAYERS), "mlp_hidden_size": ("pos", True, 1 << 20),
              "vocab_size": ("pos", True, _VOCAB), "embedding_size": ("pos", False, _VOCAB),
              "max_sequence_length": ("pos", False, _POS), "rope_theta": ("real", False, None),
              "rms_norm_eps": ("real", False, None), "mask_token_id": ("id", True, None),
              "eos_token_id": ("id", False, None), "pad_token_id": ("id", False, None),
              "eot_token_id": ("id", False, None), "block_causal_size": ("pos", False, _POS),
              "weight_tying": ("bool", False, None), "block_type": ("str", False, None),
              "attention_mode": ("str", False, None)},
    "Dream": {"hidden_size": ("pos", True, _DIM), "num_attention_heads": ("pos", True, _DIM),
              "num_key_value_heads": ("pos", False, _DIM), "num_hidden_layers": ("pos", True, _LAYERS),
              "intermediate_size": ("pos", True, 1 << 20), "vocab_size": ("pos", True, _VOCAB),
              "max_position_embeddings": ("pos", False, _POS), "rope_theta": ("real", False, None),
              "rms_norm_eps": ("real", False, None), "initializer_range": ("nonneg", False, None),
              "mask_token_id": ("id", True, None), "eos_token_id": ("id", False, None),
              "pad_token_id": ("id", False, None), "bos_token_id": ("id", False, None),
              "eot_token_id": ("id", False, None), "tie_word_embeddings": ("bool", False, None),
              "hidden_act": ("str", False, None), "sliding_window": ("pos", False, _POS)},
    "llada2_moe": {"hidden_size": ("pos", True, _DIM), "num_attention_heads": ("pos", True, _DIM),
                   "num_key_value_heads": ("pos", False, _DIM), "num_hidden_layers": ("pos", True, _LAYERS),
                   "intermediate_size": ("pos", True, 1 << 20), "vocab_size": ("pos", True, _VOCAB),
                   "head_dim": ("pos", False, _DIM), "max_position_embeddings": ("pos", False, _POS),
                   "rope_theta": ("real", False, None), "rms_norm_eps": ("real", False, None),
                   "partial_rotary_factor": ("real", False, None), "num_experts": ("pos", False, 1 << 16),
                   "num_experts_per_tok": ("pos", False, 1 << 16), "n_group": ("pos", False, 1 << 16),
                   "topk_group": ("pos", False, 1 << 16), "routed_scaling_factor": ("real", False, None),
                   "moe_intermediate_size": ("pos", False, 1 << 20), "num_shared_experts": ("pos", False, 1 << 10),
                   "first_k_dense_replace": ("nonneg_int", False, _LAYERS), "pad_token_id": ("id", False, None),
                   "eos_token_id": ("id", False, None), "mask_token_id": ("id", False, None),
                   "block_size": ("pos", False, _POS), "tie_word_embeddings": ("bool", False, None),
                   "use_qkv_bias": ("bool", False, None), "use_bias": ("bool", False, None),
                   "use_qk_norm": ("bool", False, None), "hidden_act": ("str", False, None)},
}
_QWEN_BD = {"hidden_size": ("pos", True, _DIM), "num_attention_heads": ("pos", True, _DIM),
            "num_key_value_heads": ("pos", False, _DIM), "num_hidden_layers": ("pos", True, _LAYERS),
            "intermediate_size": ("pos", True, 1 << 20), "vocab_size": ("pos", True, _VOCAB),
            "head_dim": ("pos", False, 1 << 12), "max_position_embeddings": ("pos", False, _POS),
            "rope_theta": ("real", False, None), "rms_norm_eps": ("real", False, None),
            "initializer_range": ("nonneg", False, None), "mask_token_id": ("id", False, None),
            "pad_token_id": ("id", False, None), "bos_token_id": ("id", False, None),
            "tie_word_embeddings": ("bool", False, None), "hidden_act": ("str", False, None)}
CONFIG_FIELDS["Fast_dLLM_Qwen"] = dict(_QWEN_BD, bd_size=("pos", False, _POS), eos_token_id=("id", False, None))
CONFIG_FIELDS["sdar"] = dict(_QWEN_BD, block_size=("pos", False, _POS), eos_token_id=("id", False, None))


def check_config_json(raw: dict, where: str) -> None:
    """Types and ranges of a supported architecture's config.json (UserError naming ``where`` -- the file --
    and the key), so a malformed checkpoint fails in one line instead of deep inside the model's constructor."""
    import math

    fields = CONFIG_FIELDS.get(raw.get("model_type"), {})

    def bad(key: str, why: str) -> UserError:
        return UserError(f"{where}: {key}={json.dumps(raw.get(key))[:60]} {why}")

    for key, (kind, required, hi) in fields.items():
        v = raw.get(key)
        if v is None:
            if required:
                raise UserError(f"{where} has no {key}")
            continue
        if kind in ("pos", "id", "nonneg_int"):
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(key, "is not an integer")
            lo = 1 if kind == "pos" else 0
            if v < lo or (hi is not None and v > hi):
                raise bad(key, f"is outside {lo}..{hi if hi is not None else 'the vocabulary'}")
        elif kind in ("real", "nonneg"):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                    or (kind == "real" and v == 0):
                raise bad(key, "is not a finite number " + ("> 0" if kind == "real" else ">= 0"))
        elif kind == "bool" and not isinstance(v, bool):
            raise bad(key, "is not true or false")
        elif kind == "str" and not isinstance(v, str):
            raise bad(key, "is not a string")
    if not fields:
        return
    vocab = max(raw.get("vocab_size") or 0, raw.get("embedding_size") or 0)
    for key, (kind, _, _) in fields.items():
        if kind == "id" and raw.get(key) is not None and raw[key] >= vocab:
            raise bad(key, f"is outside the vocabulary (0..{vocab - 1})")
    heads, dim, kv = (("n_heads", "d_model", "n_kv_heads") if raw["model_type"] == "llada"
                      else ("num_attention_heads", "hidden_size", "num_key_value_heads"))
    if raw.get("head_dim") is None and raw[dim] % raw[heads]:
        raise bad(dim, f"is not divisible by {heads}={raw[heads]}")
    if raw.get(kv) is not None and raw[heads] % raw[kv]:
        raise bad(heads, f"is not a multiple of {kv}={raw[kv]}")


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if path.exists() and not path.is_dir():
        raise UserError(f"model.path: '{path}' is a file, not a directory (give the checkpoint directory that holds "
                        "config.json and the weights)")
    if not path.is_dir():
        raise UserError(f"model.path: checkpoint directory '{path}' does not exist")
    if not cfg_file.is_file():
        raise UserError(f"model.path: '{path}' has no config.json (not a checkpoint directory)")
    try:
        with open(cfg_file) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"model.path: '{cfg_file}' is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"model.path: '{cfg_file}' has no model_type")
    check_config_json(data, f"model.path: '{cfg_file}'")
    return data


def _plain_file_name(name, where: str, what: str) -> str:
    """A file named by a checkpoint's own metadata must be a plain name inside the checkpoint directory: no
    directory part, no ``..``, not absolute (a crafted index or tokenizer config must not reach elsewhere)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or os.path.isabs(name):
        raise UserError(f"model.path: '{where}' names {what} {json.dumps(name)[:80]} outside the checkpoint "
                        "directory (only plain file names inside it are read)")
    return name


def weight_files(path: Path) -> list:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise TypeError(f"weight_map is {type(weight_map).__name__}, not a non-empty object")
            names = sorted(set(weight_map.values()), key=str)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as exc:
            raise UserError(f"model.path: '{index}' is malformed ({str(exc)[:200]})") from None
        for n in names:
            if not (isinstance(n, str) and n.endswith(".safetensors")):
                raise UserError(f"model.path: '{index}' names weight file {json.dumps(n)[:80]}, not a *.safetensors file")
            _plain_file_name(n, str(index), "weight file")
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
            if v.is_floating_point():
                check_finite_weight(v, k, f)
                v = v.to(tdtype)
            state[k] = v
        del shard
    try:
        with torch.device("meta"):
            model = model_cls(config)
    except (TypeError, ValueError) as exc:
        raise UserError(f"model.path: '{path / 'config.json'}' is malformed ({exc})") from None
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


def check_finite_weight(t: torch.Tensor, name: str, file) -> None:
    """A weight holding NaN or infinity decodes garbage: refuse it at load, naming the tensor and the file.
    Checked in chunks of 16M values (a bounded temporary, one device sync per chunk, at load time only)."""
    flat = t.reshape(-1)
    for part in flat.split(1 << 24):
        if not bool(torch.isfinite(part).all()):
            bad = sum(int((~torch.isfinite(p)).sum()) for p in flat.split(1 << 24))
            raise UserError(f"model.path: weight '{name}' in '{file}' holds {bad} non-finite value(s) (NaN or "
                            f"infinity) of {t.numel()}")


def build_random(config: dict, seed: int = 0, device: str = "cpu", dtype: str = "float32"):
    """A seeded random model from a config dict (no files needed)."""
    raw = dict(config)
    model_type = raw.pop("model_type", "llada")
    config_cls, model_cls = architecture(model_type)
    check_config_json(dict(raw, model_type=model_type), "model.random")  # (a preset's random model config)
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
