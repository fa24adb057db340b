"""device=auto / dtype=auto: bf16 (fp16 without bf16 support) on CUDA, float32 on CPU; half-precision models
still decode (checked on CPU, where bf16 kernels exist)."""
from pathlib import Path

import pytest
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.errors import UserError
from dlm_engine.core.loop import decode
from dlm_engine.models.loader import load_pretrained, resolve_device, resolve_dtype
from dlm_engine.core.registry import cache_class, strategy_class

FIX = Path(__file__).resolve().parent / "fixtures"


def test_auto_is_float32_on_cpu():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_is_half_precision_on_cuda(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_dtype("auto", torch.device("cuda")) == expected


def test_device_auto_follows_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UserError, match="device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto").type == "cuda"


@pytest.mark.parametrize("model_dir, mask, strategy, kw", [
    ("dreamparity/tiny_dream", 1000, "dream", {"alg": "entropy", "steps": 8, "temperature": 0.5, "top_p": 0.9}),
    ("dreamparity/tiny_dream", 1000, "low_confidence", {"block_length": 8}),
    ("refparity/tiny_llada", 1000, "threshold", {"block_length": 8}),
])
def test_bfloat16_models_decode(model_dir, mask, strategy, kw):
    model, _, _ = load_pretrained(FIX / model_dir, device="cpu", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    cls = strategy_class(strategy)
    canvas = Canvas.from_prompts([[406, 710, 869, 657], [432, 865]], 16, mask, 1001)
    torch.manual_seed(0)
    with torch.no_grad():
        assert model(canvas.tokens).logits.dtype == torch.bfloat16
    decode(model, canvas, cls(cls.Config(**kw), 16), cache_class("none")(cache_class("none").Config()))
    assert not canvas.masked()[:, canvas.gen_start:].any()
    assert int(canvas.tokens.max()) < 1024


def test_sharded_bf16_checkpoint_loads_shard_by_shard_onto_the_device(tmp_path, monkeypatch):
    """An index + two bf16 shards (the released 8B layout) loads as float32 with the exact upcast values; each
    shard is read straight onto the resolved device, one at a time."""
    import json

    import safetensors.torch as st

    from dlm_engine.models import loader

    src = FIX / "refparity" / "tiny_llada"
    full = st.load_file(str(next(src.glob("*.safetensors"))))
    keys = sorted(full)
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        st.save_file({k: full[k].to(torch.bfloat16).contiguous() for k in part}, str(d / name))
        weight_map.update({k: name for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    calls = []
    real = st.load_file

    def spy(path, device="cpu"):
        calls.append((Path(path).name, device))
        return real(path, device=device)

    monkeypatch.setattr(st, "load_file", spy)
    model, _, _ = loader.load_pretrained(d, device="cpu", dtype="float32")
    assert calls == [("model-00001-of-00002.safetensors", "cpu"), ("model-00002-of-00002.safetensors", "cpu")]
    got = model.state_dict()
    for k in keys:
        assert got[k].dtype == torch.float32
        assert torch.equal(got[k], full[k].to(torch.bfloat16).float()), k
