"""Fast-dLLM v2 and SDAR (``dlm_engine/models/qwen_bd.py``) against the reference forwards of
``tests/fixtures/bdparity/{fdv2,sdar}_forward.json``: top-5 ids and logits, logsumexp and sampled logits per
position within float32 rounding (the fixtures round to 1e-5), without a cache and through the block store."""
import json

import pytest
import torch

from conftest import FIXTURES
from dlm_engine.errors import UserError
from dlm_engine.models.loader import load_pretrained

BD = FIXTURES / "bdparity"
TOL = 5e-5


def forwards(suite):
    return json.loads((BD / f"{suite}_forward.json").read_text())["inputs"]


@pytest.fixture(scope="module")
def fdv2():
    return load_pretrained(BD / "tiny_fdv2")[0]


@pytest.fixture(scope="module")
def sdar():
    return load_pretrained(BD / "tiny_sdar")[0]


def check(logits: torch.Tensor, ref: dict) -> None:
    lg = logits.float()
    top = lg.topk(5, -1)
    assert top.indices.tolist() == ref["top5_ids"]
    assert (top.values - torch.tensor(ref["top5_logits"])).abs().max() < TOL
    assert (lg.logsumexp(-1) - torch.tensor(ref["logsumexp"])).abs().max() < TOL
    assert (lg.softmax(-1).amax(-1) - torch.tensor(ref["max_prob"])).abs().max() < TOL
    for r, c, v in ref["samples"]:
        assert abs(float(lg[r, c]) - v) < TOL


def test_configs_and_ids(fdv2, sdar):
    assert type(fdv2).__name__ == "FastDLLMv2Model" and fdv2.logits_shift == 1 and fdv2.block_size == 32
    assert fdv2.config.mask_token_id == 1012            # |<MASK>|, 22 ids after <|endoftext|> (no config key)
    assert type(sdar).__name__ == "SDARModel" and sdar.logits_shift == 0 and sdar.block_size == 4
    assert sdar.config.mask_token_id == 1016
    assert hasattr(sdar.model.layers[0].self_attn, "q_norm") and sdar.model.layers[0].self_attn.q_proj.bias is None
    assert fdv2.model.layers[0].self_attn.q_proj.bias is not None


@torch.no_grad()
def test_fdv2_forward_uncached(fdv2):
    f = forwards("fdv2")
    pre = f["prefill"]["input_ids"]
    check(fdv2(torch.tensor([pre]), shift_logits=False, block_size=32).logits[0], f["prefill"])
    for name in ("decode_cached", "store"):        # = rows 64..95 of a block-causal forward of all 96 ids
        out = fdv2(torch.tensor([pre + f[name]["input_ids"]]), shift_logits=False, block_size=32).logits[0, 64:]
        check(out, f[name])
    ids = f["decode_block64_default_mask32"]["input_ids"]    # a 64-token block under a block-32 mask (quirk 1)
    check(fdv2(torch.tensor([ids]), shift_logits=False, block_size=32).logits[0], f["decode_block64_default_mask32"])
    wide = fdv2(torch.tensor([ids]), shift_logits=False, block_size=64).logits[0]
    assert (wide[:32] - fdv2(torch.tensor([ids]), shift_logits=False, block_size=32).logits[0, :32]).abs().max() > 1


@torch.no_grad()
def test_fdv2_shift_reads_the_previous_hidden_state_within_the_call(fdv2):
    ids = torch.tensor([forwards("fdv2")["prefill"]["input_ids"][:32]])
    raw = fdv2(ids, shift_logits=False).logits
    shifted = fdv2(ids).logits
    assert torch.equal(shifted[:, 1:], raw[:, :-1]) and torch.equal(shifted[:, 0], raw[:, 0])


@torch.no_grad()
def test_sdar_forward_uncached(sdar):
    f = forwards("sdar")
    pre = f["prefill"]["input_ids"]
    check(sdar(torch.tensor([pre]), shift_logits=False, block_size=4).logits[0], f["prefill"])
    out = sdar(torch.tensor([pre + f["decode_cached"]["input_ids"]]), block_size=4).logits[0, 16:]
    check(out, f["decode_cached"])
    check(sdar(torch.tensor([f["prefill_one_block"]["input_ids"]]), block_size=4).logits[0], f["prefill_one_block"])


def test_sdar_without_mask_id_is_refused(tmp_path):
    raw = json.loads((BD / "tiny_sdar" / "config.json").read_text())
    raw.pop("mask_token_id")
    raw.pop("bos_token_id")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes((BD / "tiny_sdar" / "model.safetensors").read_bytes())
    with pytest.raises(UserError, match="mask_token_id"):
        load_pretrained(tmp_path)
