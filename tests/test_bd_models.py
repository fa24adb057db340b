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


# -- through the block store (cache=block_kv): what the references' cached forwards compute -------------------
def cached_call(model, cache, ids, block, store=False, query=None, attention_block=None, window=None):
    from dlm_engine.core.protocol import CacheDirective, CallRequest

    d = CacheDirective(block=block, block_start=False, store=[block] if store else [], query=query,
                       attention_block=attention_block)
    lo, hi = window or (query or block)
    call = model(ids, hooks=cache, request=CallRequest(directive=d), logits_range=(lo, hi), shift_logits=False)
    return call, d


@pytest.fixture
def block_kv():
    from dlm_engine.core.registry import cache_class

    cls = cache_class("block_kv")
    return cls(cls.Config())


@torch.no_grad()
def test_sdar_forward_through_the_block_store(sdar, block_kv):
    f = forwards("sdar")
    ids = torch.tensor([f["prefill"]["input_ids"] + f["decode_cached"]["input_ids"]])
    block_kv.begin(None)
    call, d = cached_call(sdar, block_kv, ids, (0, 16), store=True, attention_block=4)
    check(call.logits[0], f["prefill"])
    assert d.stored == [(0, 16)] and call.compute == (0, 16)
    call, d = cached_call(sdar, block_kv, ids, (16, 20), attention_block=4)
    assert call.compute == (16, 20) and d.stored == []          # only the block is computed, nothing stored
    check(call.logits[0], f["decode_cached"])


@torch.no_grad()
def test_fdv2_forward_through_the_block_store(fdv2, block_kv):
    f = forwards("fdv2")
    pre = f["prefill"]["input_ids"]
    block_kv.begin(None)
    ids = torch.tensor([pre + f["decode_cached"]["input_ids"]])
    call, d = cached_call(fdv2, block_kv, ids, (0, 64), store=True, attention_block=32)
    check(call.logits[0], f["prefill"])
    call, _ = cached_call(fdv2, block_kv, ids, (64, 96), attention_block=32)
    check(call.logits[0], f["decode_cached"])
    # the block cache: a full forward of the block, then a sub-block query against its (stale) slots
    sub = f["blockcache_sub_query"]
    ids = torch.tensor([pre + sub["block"]])
    cached_call(fdv2, block_kv, ids, (64, 96), attention_block=32)
    ids[0, 72:80] = torch.tensor(sub["input_ids"])
    call, _ = cached_call(fdv2, block_kv, ids, (64, 96), query=(72, 80), attention_block=32)
    assert call.compute == (72, 80)
    check(call.logits[0], sub)
    # the store forward of a finished block
    ids = torch.tensor([pre + f["store"]["input_ids"]])
    call, d = cached_call(fdv2, block_kv, ids, (64, 96), store=True, attention_block=32)
    check(call.logits[0], f["store"])
    assert d.stored == [(64, 96)]


def test_block_store_refuses_a_query_without_its_keys(fdv2, block_kv):
    ids = torch.tensor([forwards("fdv2")["prefill"]["input_ids"]])
    block_kv.begin(None)
    with pytest.raises(RuntimeError, match="never computed"):
        cached_call(fdv2, block_kv, ids, (32, 64), attention_block=32)
