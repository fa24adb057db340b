"""LLaDA2.x MoE model (``llada2_moe``): loading the official format, the forward against the reference's
(``llada2_forward.json``: block-causal, cached last block, no mask; float32 and bfloat16, both versions), the
router's choices, and the batched expert dispatch equal to the per-token loop."""
import json

import pytest
import torch

from conftest import FIXTURES
from dlm_engine.errors import UserError
from dlm_engine.models.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM, MoE, dispatch, dispatch_per_token
from dlm_engine.models.loader import build_random, load_pretrained

BD = FIXTURES / "bdparity"
FWD = json.loads((BD / "llada2_forward.json").read_text())


@pytest.fixture(scope="module", params=[("llada2", "float32"), ("llada2", "bfloat16"), ("llada21", "float32"),
                                        ("llada21", "bfloat16")], ids=lambda p: "-".join(p))
def loaded(request):
    ver, dtype = request.param
    model, raw, _ = load_pretrained(BD / f"tiny_{ver}", dtype=dtype)
    return ver, dtype, model


def _logits(model, name):
    ids = torch.tensor([FWD["inputs"][name]])
    with torch.no_grad():
        if name.startswith("A"):
            return model(ids, block_size=8).logits[0]
        if name.startswith("C"):                      # no mask at all: one block covering everything
            return model(ids, block_size=1 << 20).logits[0]
        return model(ids, block_size=8).logits[0, 16:]


def test_loads_official_format(loaded):
    ver, dtype, model = loaded
    assert type(model).__name__ == "LLaDA2MoeModelLM"
    assert model.mask_token_id == FWD["mask_id"] == 1020 and model.config.eos_token_id == FWD["eos_id"]
    assert next(model.parameters()).dtype == getattr(torch, dtype)
    assert type(model.model.layers[0].mlp).__name__ == "SwiGLU" and isinstance(model.model.layers[1].mlp, MoE)


@pytest.mark.parametrize("name", ["A_block_causal", "B_cached_last_block", "C_no_attention_mask"])
def test_forward_matches_reference(loaded, name):
    ver, dtype, model = loaded
    ref = FWD["versions"][ver][dtype][name]
    got = _logits(model, name)
    assert got.dtype == torch.float32
    assert got.argmax(-1).tolist() == ref["argmax"]
    assert got.topk(5, dim=-1).indices.tolist() == ref["top5_ids"]
    tol = 2.5e-4 if dtype == "float32" else 0.26          # bf16: a few ulps of logits around 20-30
    assert torch.allclose(got.topk(5, dim=-1).values, torch.tensor(ref["top5_logits"]), atol=tol, rtol=0)
    for pos, tok, val in ref["sampled"]:
        assert abs(float(got[pos, tok]) - val) <= tol
    if "logits_1e-5" in ref:                              # full rows of the last block, float32
        rows = ref["rows"]                                 # (B: rows of the 8 computed queries)
        assert torch.allclose(got[rows], torch.tensor(ref["logits_1e-5"]), atol=5e-5, rtol=0)


def test_router_choices_match_reference(loaded):
    ver, dtype, model = loaded
    ref = FWD["versions"][ver][dtype]["A_block_causal"].get("router")
    if ref is None:
        pytest.skip("router choices are recorded for float32 only")
    seen = {}

    def hook(mod, args, out):
        seen[mod.layer_index] = out

    handles = []
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate.layer_index = i
            handles.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        _logits(model, "A_block_causal")
    finally:
        for h in handles:
            h.remove()
    for r in ref:
        idx, w = seen[int(r["layer"])]
        assert idx.tolist() == r["topk_idx"]
        if "topk_weight" in r:
            assert torch.allclose(w, torch.tensor(r["topk_weight"]), atol=1e-5)


def test_batched_dispatch_equals_the_per_token_loop():
    cfg = dict(model_type="llada2_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_experts=16, num_experts_per_tok=4, n_group=4,
               topk_group=2, moe_intermediate_size=8, pad_token_id=60)
    model, _, _ = build_random(cfg, seed=3)
    moe = model.model.layers[1].mlp
    torch.manual_seed(0)
    moe.gate.expert_bias.normal_(0, 0.2)
    moe.gate.weight.data.normal_(0, 0.5)                        # (the init std 0.02 routes every token alike)
    x = torch.randn(37, 32)
    with torch.no_grad():
        idx, w = moe.gate(x)
        assert idx.shape == (37, 4) and torch.allclose(w.sum(-1), torch.full((37,), 2.5))
        assert len(set(map(tuple, (idx // 4).sort(-1).values.tolist()))) > 1          # routing varies
        for row in (idx // 4).tolist():                                               # at most topk_group groups
            assert len(set(row)) <= 2
        a = dispatch(x, idx, w, moe.experts)
        b = dispatch_per_token(x, idx, w, moe.experts)
    assert torch.allclose(a, b, atol=1e-6)


def test_expert_bias_decides_selection_only():
    cfg = LLaDA2MoeConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                          vocab_size=32, num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                          moe_intermediate_size=4, intermediate_size=8, pad_token_id=20)
    model = LLaDA2MoeModelLM(cfg)
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(5, 16)
    with torch.no_grad():
        gate.expert_bias.zero_()
        gate.expert_bias[3] = gate.expert_bias[6] = 10.0            # forces experts 3 and 6 ...
        idx, w = gate(x)
        s = torch.sigmoid(x @ gate.weight.T)
    assert sorted(map(tuple, idx.sort(-1).values.tolist())) == [(3, 6)] * 5
    want = s[:, [3, 6]] / s[:, [3, 6]].sum(-1, keepdim=True) * 2.5      # ... but weighs them without the bias
    assert torch.allclose(w.sort(-1).values, want.sort(-1).values, atol=1e-6) or torch.allclose(
        w, want[:, [int(idx[0, 0] != 3), int(idx[0, 0] == 3)]], atol=1e-6)


def test_block_causal_mask_is_aligned_to_column_zero():
    model, _, _ = load_pretrained(BD / "tiny_llada2")
    x = torch.tensor([FWD["inputs"]["A_block_causal"]])
    y = x.clone()
    y[0, 8:] = 5                                       # change block 1 (columns 8..15)
    with torch.no_grad():
        a, b = model(x, block_size=8).logits, model(y, block_size=8).logits
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-5, rtol=0) and not torch.allclose(a[:, 8:], b[:, 8:])


def test_bad_config_is_one_line(tmp_path):
    raw = json.loads((BD / "tiny_llada2" / "config.json").read_text())
    raw["n_group"] = 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes((BD / "tiny_llada2" / "model.safetensors").read_bytes())
    with pytest.raises(UserError, match="n_group 3"):
        load_pretrained(tmp_path)
    raw["n_group"] = 4
    raw.pop("pad_token_id")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="mask_token_id"):
        load_pretrained(tmp_path)


def test_cached_block_matches_reference(loaded):
    """Input B through the block store: the first call stores the prompt's two blocks, the second computes only the
    last block against them (what the reference's DynamicCache forward did)."""
    from dlm_engine.core.protocol import CacheDirective, CallRequest
    from dlm_engine.core.registry import cache_class

    ver, dtype, model = loaded
    ref = FWD["versions"][ver][dtype]["B_cached_last_block"]
    ids = torch.tensor([FWD["inputs"]["B_cached_last_block"]])
    cache = cache_class("block_store")()
    spans = []
    with torch.no_grad():
        for _ in range(2):
            req = CallRequest(gen_start=16, directive=CacheDirective(block=(16, 24), block_start=False, attention_block=8))
            call = model(ids, hooks=cache, logits_range=(16, 24), request=req)
            spans.append(call.compute)
    assert spans == [(0, 24), (16, 24)]
    got = call.logits[0]
    assert got.argmax(-1).tolist() == ref["argmax"]
    tol = 2.5e-4 if dtype == "float32" else 0.26
    assert torch.allclose(got.topk(5, dim=-1).values, torch.tensor(ref["top5_logits"]), atol=tol, rtol=0)
    if "logits_1e-5" in ref:
        assert torch.allclose(got, torch.tensor(ref["logits_1e-5"]), atol=5e-5, rtol=0)
