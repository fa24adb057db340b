"""Issue 48 item 4: caches stay correct when a strategy rewrites tokens (``edit``'s T2T edits, ``wino``'s
re-masks). Every cache a rewriting strategy pairs with (by capability, so a new cache is covered without a
change here) must decode as the no-cache decode does -- tokens, ``step_of`` and each row's NFE -- on runs where
many edits happen; a cache that cannot keep that is refused with one line."""
import pytest
import torch

from conftest import FIXTURES
from dlm_engine.app.sinks import RecordingSink
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.capabilities import incompatibility
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import CACHES, cache_class, load_plugins, strategy_class
from dlm_engine.models.loader import load_pretrained

from fakes import ScriptedModel, random_script

load_plugins()

BD = FIXTURES / "bdparity"
REWRITING = {"edit": dict(block_length=8, threshold=0.9, editing_threshold=0.1, max_post_steps=4),
             "wino": dict(block_length=8)}


# known gaps that are not about rewrites (they fail for non-editing strategies too):
# dllm on the block-causal LLaDA2 models crashes in its adaptive update (llada2 alike: cached and fresh response
# values differ in length); block_store on a shifted-logit fake with column-0-aligned blocks (tests/
# test_scripted_model.py KNOWN: the first generated column's logits come from the frozen prompt)
KNOWN_MODEL = {"dllm"}
KNOWN_FAKE = {("edit", "block_store", 1)}


def _strategy(name, gen):
    cls = strategy_class(name)
    return cls(cls.Config(**REWRITING[name]), gen)


def _caches(name):
    return sorted(c for c, ccls in CACHES.items() if incompatibility(_strategy(name, 32), ccls()) is None)


def _decode(model, prompts, name, cache, gen, mask, eos):
    canvas = Canvas.from_prompts(prompts, gen, mask, eos, eos_id=eos)
    rec = RecordingSink()
    c = cache_class(cache)(cache_class(cache).Config())
    with torch.inference_mode():
        decode(model, canvas, _strategy(name, gen), cache=c, sinks=[rec])
    return canvas, rec


def _rewrites(rec):
    """Writes over a written token (edits) and re-masks of the run."""
    n = 0
    for d in rec.deltas:
        if "edits" in d.scalars:
            n += int(d.scalars["edits"].sum())
        if d.remask is not None:
            n += int(d.remask.sum())
    return n


def _same(got, ref):
    assert torch.equal(got.tokens, ref.tokens)
    assert torch.equal(got.step_of, ref.step_of)
    assert torch.equal(got.row_nfe, ref.row_nfe)


@pytest.fixture(scope="module")
def tiny21():
    return load_pretrained(BD / "tiny_llada21")[0]


def test_edit_pairs_with_the_store_caches_and_refuses_d2cache():
    assert {"none", "block_store", "prefix", "dual", "dllm"} <= set(_caches("edit"))
    why = incompatibility(_strategy("edit", 32), cache_class("d2cache")())
    assert why and "\n" not in why and "cache=d2cache" in why and "strategy=edit" in why and "block_logits" in why


@pytest.mark.parametrize("cache", _caches("edit"))
def test_edit_under_every_cache_equals_the_no_cache_decode(tiny21, cache):
    if cache in KNOWN_MODEL:
        pytest.xfail("dllm x block-causal LLaDA2 model: a known gap not about edits (see KNOWN_MODEL)")
    import json
    prompts = json.loads((BD / "llada21.json").read_text())["prompts"]
    for prompt in (prompts[2], prompts[3]):
        ref, rec = _decode(tiny21, [prompt], "edit", "none", 32, tiny21.mask_token_id, 1017)
        assert _rewrites(rec) > 5                          # the comparison covers many rewritten tokens
        got, _ = _decode(tiny21, [prompt], "edit", cache, 32, tiny21.mask_token_id, 1017)
        _same(got, ref)


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("name", sorted(REWRITING))
def test_rewriting_strategies_under_every_cache_on_a_token_dependent_fake(name, shift):
    V, gen = 50_000, 16
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16]]
    strategy = _strategy(name, gen)
    prompts = prompts[:1] if strategy.max_batch == 1 else prompts
    ref, _ = _decode(ScriptedModel(random_script(), V, shift=shift), prompts, name, "none", gen, V - 1, V - 2)
    for cache in _caches(name):
        if (name, cache, shift) in KNOWN_FAKE:
            continue
        got, _ = _decode(ScriptedModel(random_script(), V, shift=shift), prompts, name, cache, gen, V - 1, V - 2)
        _same(got, ref)
