"""The LLaDA model: forward parity with the reference, Auto-class registration, safe loading errors."""
import json
import shutil

import pytest
import torch

from conftest import REFPARITY
from dlm_engine.errors import UserError
from dlm_engine.models.loader import load_pretrained


def test_forward_matches_reference(tiny_llada):
    ref = json.loads((REFPARITY / "model_forward.json").read_text())
    for case in ref["cases"]:
        x = torch.tensor([case["input"]])
        with torch.no_grad():
            logits = tiny_llada(x).logits[0]
        top = logits.topk(5, dim=-1)
        assert top.indices.tolist() == case["top5_ids"]
        assert torch.allclose(top.values, torch.tensor(case["top5_logits"]), atol=1e-4, rtol=0)
        assert torch.allclose(logits.logsumexp(-1), torch.tensor(case["logsumexp"]), atol=1e-4, rtol=0)


def test_logits_window_and_padding(tiny_llada):
    """A logits window equals the slice of full logits; a left-padded row equals the row alone."""
    x = torch.tensor([[735, 559, 771, 678, 375, 377] + [1000] * 8])
    with torch.no_grad():
        full = tiny_llada(x).logits
        part = tiny_llada(x, logits_range=(6, 10)).logits
        padded = torch.cat([torch.full((1, 3), 1001), x], dim=1)
        mask = torch.ones_like(padded, dtype=torch.bool)
        mask[:, :3] = False
        pl = tiny_llada(padded, attention_mask=mask).logits[:, 3:]
    assert torch.allclose(full[:, 6:10], part, atol=1e-6)
    assert torch.allclose(full, pl, atol=1e-4)  # masked SDPA takes another kernel path


def test_auto_classes_without_remote_code():
    from transformers import AutoConfig, AutoModel

    from dlm_engine.models.llada import LLaDAModelLM, register_auto_classes

    register_auto_classes()
    cfg = AutoConfig.from_pretrained(str(REFPARITY / "tiny_llada"), trust_remote_code=False)
    assert cfg.model_type == "llada"
    model = AutoModel.from_pretrained(str(REFPARITY / "tiny_llada"), trust_remote_code=False)
    assert isinstance(model, LLaDAModelLM)
    ours, _, _ = load_pretrained(REFPARITY / "tiny_llada")
    for (k1, v1), (k2, v2) in zip(sorted(model.state_dict().items()), sorted(ours.state_dict().items())):
        assert k1 == k2 and torch.equal(v1, v2)


def test_official_parameter_names(tiny_llada):
    names = set(tiny_llada.state_dict())
    assert "model.transformer.wte.weight" in names
    assert "model.transformer.blocks.1.attn_out.weight" in names
    assert "model.transformer.ff_out.weight" in names


@pytest.mark.parametrize("breakage, needle", [
    ("missing", "does not exist"),
    ("no_config", "no config.json"),
    ("bad_json", "not valid JSON"),
    ("pickle_only", "safetensors only"),
    ("bad_shape", "wrong shapes"),
])
def test_loader_errors_name_the_path(tmp_path, breakage, needle):
    d = tmp_path / "ckpt"
    if breakage != "missing":
        shutil.copytree(REFPARITY / "tiny_llada", d)
    if breakage == "no_config":
        (d / "config.json").unlink()
    elif breakage == "bad_json":
        (d / "config.json").write_text("{not json")
    elif breakage == "pickle_only":
        (d / "model.safetensors").unlink()
        (d / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    elif breakage == "bad_shape":
        cfg = json.loads((d / "config.json").read_text())
        cfg["d_model"] = 32
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as err:
        load_pretrained(d)
    assert needle in str(err.value)
    assert str(d) in str(err.value) or "d_model" in str(err.value) or "ckpt" in str(err.value)
