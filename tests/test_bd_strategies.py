"""Issue 45 item 5: the existing block-by-block strategies on every block-diffusion family (Fast-dLLM v2, SDAR,
LLaDA2.0 / 2.1), with the model's block size; a conflicting block_length or a whole-canvas strategy is a one-line
error."""
import pytest

from conftest import FIXTURES
from dlm_engine.app.api import load_directory
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class
from dlm_engine.errors import ConfigError

BD = FIXTURES / "bdparity"
FAMILIES = ("tiny_fdv2", "tiny_sdar", "tiny_llada2", "tiny_llada21")
_LOADED = {}


def lm_of(name):
    if name not in _LOADED:
        _LOADED[name] = load_directory(str(BD / name), name=name)
    return _LOADED[name]


def make(kind, name, **kw):
    load_plugins()
    cls = (strategy_class if kind == "strategy" else cache_class)(name)
    return cls, cls.Config(**kw)


def decode_once(lm, name, cache, prompt, gen, **kw):
    S, sc = make("strategy", name, **kw)
    C, cc = make("cache", cache)
    canvas = Canvas.from_prompts([prompt], gen, lm.mask_id, lm.pad_id)
    decode(lm.model, canvas, S(sc, gen), cache=C(cc))
    return canvas


STRATEGIES = (("threshold", dict(threshold=0.9)), ("low_confidence", dict(steps=None)), ("factor", dict(factor=1.0)),
              ("d2c", dict()))


@pytest.mark.slow   # 16 cases, ~10 s (the MoE families): in-process but seconds long: kept out of the quick tier (CI runs it)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name,kw", STRATEGIES, ids=[s for s, _ in STRATEGIES])
def test_block_by_block_strategies_run_with_the_model_block_size(family, name, kw):
    lm = lm_of(family)
    bs = lm.model.block_size
    gen = 2 * bs
    kw = dict(kw)
    if "steps" in kw:
        kw["steps"] = gen
    out = {}
    # a prompt whose length is not a multiple of the block size (the case LLaDA2's position-0 blocks got wrong)
    prompt = list(range(40, 40 + bs + 3))
    for cache in ("none", "prefix"):
        canvas = decode_once(lm, name, cache, prompt, gen, block_length=bs, **kw)
        assert not canvas.masked().any()
        out[cache] = canvas.tokens.tolist()
    assert out["none"] == out["prefix"]           # blocks of the model's size: the prefix cache is exact


def test_llada2_mask_counts_blocks_from_the_generation_start():
    """A block-by-block strategy's first block starts at the prompt end; the mask's blocks must be the strategy's
    (the prompt one block before them), so a later block's columns never reach the working block."""
    from dlm_engine.core.protocol import CacheDirective, CallRequest
    import torch
    lm = lm_of("tiny_llada2")
    bs = lm.model.block_size
    P = bs + 3
    ids = torch.tensor([list(range(40, 40 + P)) + [lm.mask_id] * (2 * bs)])
    req = lambda: CallRequest(gen_start=P, directive=CacheDirective(block=(P, P + bs), block_start=False))
    with torch.no_grad():
        a = lm.model(ids, logits_range=(P, P + bs), request=req()).logits
        ids2 = ids.clone()
        ids2[0, P + bs:] = 7                  # the next block changes: the working block's logits must not
        b = lm.model(ids2, logits_range=(P, P + bs), request=req()).logits
        ids3 = ids.clone()
        ids3[0, P + 1] = 7                    # the working block itself is bidirectional: its first column sees it
        c = lm.model(ids3, logits_range=(P, P + bs), request=req()).logits
    assert torch.equal(a, b)
    assert not torch.allclose(a[0, 0], c[0, 0])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_conflicting_block_length_or_a_whole_canvas_strategy_is_refused(family):
    lm = lm_of(family)
    bs = lm.model.block_size
    canvas = Canvas.from_prompts([[1, 2, 3]], 4 * bs, lm.mask_id, lm.pad_id)
    S, sc = make("strategy", "threshold", block_length=2 * bs)
    with pytest.raises(ConfigError, match=rf"strategy\.block_length={2 * bs} conflicts with the block size") as e:
        decode(lm.model, canvas, S(sc, 4 * bs))
    assert "\n" not in str(e.value)
    S, sc = make("strategy", "d2c")           # null block_length = the whole generation: also a conflict
    with pytest.raises(ConfigError, match=rf"strategy\.block_length={4 * bs} conflicts"):
        decode(lm.model, canvas, S(sc, 4 * bs))
    W, wc = make("strategy", "wino")
    with pytest.raises(ConfigError, match=r"strategy=wino needs bidirectional attention") as e:
        decode(lm.model, canvas, W(wc, 4 * bs))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family,name", [("tiny_llada2", "llada2"), ("tiny_llada21", "edit")])
def test_llada2_own_strategies_set_their_block_size(family, name):
    """LLaDA2's own decoders name their mask's block size; any block_length is theirs, not a conflict."""
    lm = lm_of(family)
    bs = lm.model.block_size
    canvas = decode_once(lm, name, "none", list(range(40, 45)), 2 * bs, block_length=bs // 2)
    assert canvas.nfe > 0


@pytest.mark.slow      # (builds each block-diffusion family per strategy: ~30 s on 2 cores)
def test_the_strategy_family_table_is_generated_from_the_capability_check():
    """docs/compatibility.md's strategy x family table (checked against the page by tests/test_issue47.py)."""
    from dlm_engine.app.compat import FAMILIES, family_cells

    table = {s: (cells, why) for s, cells, why in family_cells()}
    names = [t for t, _, _ in FAMILIES]
    assert names == ["Fast-dLLM v2", "SDAR", "LLaDA2.x"]
    assert table["threshold"][0] == ["`block_length=32`", "`block_length=4`", "`block_length=32`"]
    assert table["wino"][0] == ["refused"] * 3 and "needs bidirectional attention" in table["wino"][1]
    assert "\n" not in table["wino"][1]
    for own in ("fdv2", "fdv2_batch", "sdar", "llada2", "edit"):
        assert table[own][0] == ["yes"] * 3


@pytest.mark.parametrize("family", ("tiny_sdar", "tiny_llada2"))
def test_cadllm_runs_with_fixed_blocks_of_the_model_size(family):
    """CadLLM sizes its blocks adaptively: refused in one line, it runs once its blocks are the model's."""
    lm = lm_of(family)
    bs = lm.model.block_size
    gen = 2 * bs
    S, sc = make("strategy", "cadllm")
    canvas = Canvas.from_prompts([[1, 2, 3]], gen, lm.mask_id, lm.pad_id)
    with pytest.raises(ConfigError, match=r"strategy=cadllm sizes its blocks adaptively \(strategy\.adaptive_blocks"
                                          rf"=true\).*set strategy\.adaptive_blocks=false "
                                          rf"strategy\.initial_block_length={bs}") as e:
        decode(lm.model, canvas, S(sc, gen))
    assert "\n" not in str(e.value)
    S, sc = make("strategy", "cadllm", adaptive_blocks=False, initial_block_length=2 * bs)
    with pytest.raises(ConfigError, match=rf"strategy\.initial_block_length={2 * bs} conflicts"):
        decode(lm.model, canvas, S(sc, gen))
    out = {}
    for cache in ("none", "dual"):
        c = decode_once(lm, "cadllm", cache, list(range(40, 40 + bs + 3)), gen, adaptive_blocks=False,
                        initial_block_length=bs)
        assert not c.masked().any()
        out[cache] = c.tokens.tolist()
    assert out["none"] and out["dual"]


def test_dllm_cache_on_llada2_computes_every_column():
    """cache=dllm indexes the whole canvas: LLaDA2's forward must not leave out the columns after the window's
    block under it (it raised a shape error)."""
    lm = lm_of("tiny_llada2")
    bs = lm.model.block_size
    c = decode_once(lm, "threshold", "dllm", list(range(40, 40 + bs + 3)), 2 * bs, block_length=bs, threshold=0.9)
    assert not c.masked().any()
