"""Block-causal attention and the block_store cache: the mask, causality of the model, and the stored-KV
block-buffer run equal to the recompute-everything run (tokens, commit steps, NFE) in block-causal mode."""
import copy

import pytest
import torch

from conftest import record_calls
from dlm_engine.core.canvas import Canvas
from dlm_engine.errors import ConfigError
from dlm_engine.core.loop import decode
from dlm_engine.core.protocol import ForwardCall
from dlm_engine.core.protocol import CallRequest, Columns
from dlm_engine.models.layers import attention_mask
from dlm_engine.models.llada import LLaDAConfig, LLaDAModelLM
from dlm_engine.core.registry import cache_class, strategy_class
from dlm_engine.app.sinks import RecordingSink

PROMPTS = [[735, 559, 771, 678, 375, 377], [127, 157, 983, 804, 991, 537, 902, 490, 136, 103, 962], [413, 750, 0]]


@pytest.fixture(scope="module")
def block_causal(tiny_llada):
    cfg = copy.deepcopy(tiny_llada.config)
    cfg.attention_mode, cfg.block_causal_size = "block_causal", 8
    model = LLaDAModelLM(cfg)
    model.load_state_dict(tiny_llada.state_dict())
    return model.eval()


def test_attention_mask_blocks_count_from_the_generation_start():
    L, g = 10, 4
    key_mask = torch.ones(1, L, dtype=torch.bool)
    key_mask[0, 0] = False
    call = ForwardCall(input_ids=torch.zeros(1, L, dtype=torch.long), position_ids=torch.zeros(1, L), key_mask=key_mask,
                       columns=Columns.span(0, L), logits_range=(0, L), request=CallRequest(gen_start=g),
                       attention_mode="block_causal", block_size=3)
    cols = torch.arange(L)[None]
    m = attention_mask(call, cols, torch.arange(L))[0, 0]
    block = torch.tensor([-1] * 4 + [0, 0, 0, 1, 1, 1])
    want = (block[None, :] <= block[:, None]) & key_mask[0][None, :]
    assert torch.equal(m, want)
    call.attention_mode = "bidirectional"
    assert attention_mask(call, cols, torch.arange(L)).shape == (1, 1, 1, L)


def test_block_causal_model_ignores_later_blocks(block_causal, tiny_llada):
    x = torch.tensor([PROMPTS[0] + [1000] * 24])
    y = x.clone()
    y[0, 6 + 8:] = torch.arange(16) + 100            # change blocks 1 and 2
    ex = CallRequest(gen_start=6)
    with torch.no_grad():
        a = block_causal(x, request=ex).logits
        b = block_causal(y, request=ex).logits
        c = tiny_llada(x, request=ex).logits
        d = tiny_llada(y, request=ex).logits
    assert torch.allclose(a[:, :14], b[:, :14], atol=1e-6, rtol=0)       # prompt and block 0 unaffected
    assert not torch.allclose(c[:, :14], d[:, :14], atol=1e-3)           # bidirectional: affected
    with pytest.raises(ValueError, match="attention_mode"):
        LLaDAModelLM(LLaDAConfig(attention_mode="causal", n_layers=1, d_model=8, n_heads=2, mlp_hidden_size=8,
                                 vocab_size=16))


def _run(model, name, cache, prompts=PROMPTS, gen=32, **kw):
    cls = strategy_class(name)
    canvas = Canvas.from_prompts(prompts, gen, 1000, 1001)
    c = cache_class(cache)(cache_class(cache).Config())
    calls = record_calls(c)
    rec = RecordingSink()
    decode(model, canvas, cls(cls.Config(**kw), gen), cache=c, sinks=[rec])
    return canvas, rec, [compute for _, compute, _ in calls]


@pytest.mark.parametrize("kw", [dict(buffer_size=4, accept_threshold=0.9), dict(buffer_size=2, accept_threshold=0.7),
                                dict(buffer_size=1, accept_threshold=0.8)])
def test_stored_kv_equals_recompute_everything(block_causal, kw):
    kw = dict(kw, block_length=8)
    ref, ref_rec, _ = _run(block_causal, "block_buffer", "none", **kw)
    got, rec, calls = _run(block_causal, "block_buffer", "block_store", **kw)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.step_of, ref.step_of)
    assert got.nfe == ref.nfe
    g, L = got.gen_start, got.length
    stored = [(d.step, e) for d in rec.deltas for e in d.block_events if e.kind == "stored"]
    assert [e.block for _, e in stored] == list(range(len(stored))) and len(stored) >= 2
    assert not [e for d in ref_rec.deltas for e in d.block_events if e.kind == "stored"]   # no cache, no store
    # once stored, a block is never recomputed; the prompt is computed by the first call only
    assert calls[0][0] == 0 and all(a >= g for a, _ in calls[1:])
    for step, e in stored:
        assert all(a >= e.end for a, _ in calls[step:])
    assert all(b <= L for _, b in calls) and any(b < L for _, b in calls)      # later blocks not computed


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_prefix_and_dual_are_exact_with_aligned_block_causal_blocks(block_causal, cache):
    ref, _, _ = _run(block_causal, "threshold", "none", threshold=0.8, block_length=8)
    got, _, calls = _run(block_causal, "threshold", cache, threshold=0.8, block_length=8)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.step_of, ref.step_of)
    assert any(a > 0 for a, _ in calls)


def test_block_store_with_a_bidirectional_model_recomputes_the_suffix(tiny_llada):
    canvas, rec, calls = _run(tiny_llada, "block_buffer", "block_store", buffer_size=2, accept_threshold=0.7,
                              block_length=8)
    assert not canvas.masked().any()
    assert all(b == canvas.length for _, b in calls)
    assert any(e.kind == "stored" for d in rec.deltas for e in d.block_events)


def test_bad_suffix_names_the_key():
    cls = cache_class("block_store")
    with pytest.raises(ConfigError, match=r"cache\.suffix='never'"):
        cls(cls.Config(suffix="never"))
