"""The block-diffusion strategies (``fdv2``, ``fdv2_batch``, ``sdar``) and ``cache=block_kv`` beyond the reference
cases: the block store is exact (same tokens and NFE as recomputing everything), only the working block is
computed, validation names the keys, capabilities refuse what cannot work, the presets compose."""
import pytest
import torch

from conftest import FIXTURES, record_calls
from dlm_engine.app.api import load_directory, run_prompts
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.capabilities import incompatibility
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class
from dlm_engine.errors import ConfigError

BD = FIXTURES / "bdparity"
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 1, 2, 3, 4, 5], list(range(40, 59))]


@pytest.fixture(scope="module")
def fdv2():
    return load_directory(str(BD / "tiny_fdv2"), name="tiny_fdv2")


@pytest.fixture(scope="module")
def sdar():
    return load_directory(str(BD / "tiny_sdar"), name="tiny_sdar")


def make(kind, name, **kw):
    load_plugins()
    cls = (strategy_class if kind == "strategy" else cache_class)(name)
    return cls, cls.Config(**kw)


def run(lm, name, cache, gen=24, prompts=PROMPTS, **kw):
    S, sc = make("strategy", name, **kw)
    C, cc = make("cache", cache)
    res = run_prompts(lm, prompts, lambda: S(sc, gen), lambda: C(cc), gen_length=gen, batch_size=len(prompts))
    return [(r.tokens, r.nfe) for r in res.rows]


@pytest.mark.parametrize("kw", [dict(block_size=8, small_block_size=4, decode_mask_block=None),
                                dict(block_size=32, small_block_size=8, threshold=0.8),
                                dict(block_size=4, small_block_size=2, decode_mask_block=None, temperature=0.7)])
def test_fdv2_block_store_equals_recomputing_everything(fdv2, kw):
    torch.manual_seed(0)
    a = run(fdv2, "fdv2", "block_kv", **kw)
    torch.manual_seed(0)
    assert run(fdv2, "fdv2", "none", **kw) == a
    # every row is decoded to its end, or up to a stop id (masks after it are left, as the reference cuts them)
    assert all(fdv2.mask_id not in toks or fdv2.eos_id in toks[:toks.index(fdv2.mask_id)] for toks, _ in a)


@pytest.mark.parametrize("kw", [dict(block_length=4, denoising_steps=4, top_k=1),
                                dict(block_length=8, denoising_steps=4, threshold=0.9),
                                dict(sampler="generate", block_length=8, denoising_steps=8,
                                     remasking="low_confidence_dynamic", threshold=0.85)])
def test_sdar_block_store_equals_recomputing_everything(sdar, kw):
    torch.manual_seed(3)
    a = run(sdar, "sdar", "block_kv", stop_ids=[], **kw)
    torch.manual_seed(3)
    assert run(sdar, "sdar", "none", stop_ids=[], **kw) == a


def test_only_the_working_block_is_computed(sdar):
    S, sc = make("strategy", "sdar", block_length=4, denoising_steps=4, top_k=1, stop_ids=[])
    C, cc = make("cache", "block_kv")
    cache = C(cc)
    calls = record_calls(cache)
    canvas = Canvas.from_prompts([list(range(40, 50))], 14, sdar.mask_id, 0)
    decode(sdar.model, canvas, S(sc, 14), cache=cache)
    spans = [(a, b) for _, (a, b), _ in calls]
    assert spans[0] == (0, 8)                                         # prefill: the prompt's two full blocks
    assert all(b - a == 4 and a % 4 == 0 for a, b in spans[1:])       # then one block per forward
    # prefill; block [8, 12) holds the prompt tail (2 masks: 2 steps), 3 blocks of 4 masks; a store each (n_k = 1)
    assert canvas.nfe == len(calls) == 1 + (2 + 1) + 3 * (4 + 1)
    assert not canvas.masked().any()


def test_sub_block_queries_compute_only_the_sub_block(fdv2):
    S, sc = make("strategy", "fdv2", block_size=16, small_block_size=4, use_block_cache=True, threshold=0.8)
    C, cc = make("cache", "block_kv")
    cache = C(cc)
    calls = record_calls(cache)
    canvas = Canvas.from_prompts([list(range(40, 60))], 29, fdv2.mask_id, 0)
    decode(fdv2.model, canvas, S(sc, 29), cache=cache)
    widths = {b - a for _, (a, b), _ in calls}
    assert widths == {16, 4}


def test_block_cache_needs_the_block_store():
    S, sc = make("strategy", "fdv2", use_block_cache=True)
    N, nc = make("cache", "none")
    msg = incompatibility(S(sc, 64), N(nc))
    assert "block_kv" in msg and "cache=none" in msg
    S2, sc2 = make("strategy", "fdv2")
    assert incompatibility(S2(sc2, 64), N(nc)) is None


@pytest.mark.parametrize("name, kw, match", [
    ("sdar", dict(temperature=0.0), r"strategy\.temperature=0\.0 must be > 0"),
    ("sdar", dict(block_length=8, denoising_steps=3), r"block_length=8 is not divisible by strategy\.denoising_steps"),
    ("sdar", dict(remasking="low_confidence_static"), r"strategy\.remasking='low_confidence_static' \(sampler=eval"),
    ("sdar", dict(sampler="generate", remasking="entropy_bounded"), r"entropy_bounded crashes"),
    ("sdar", dict(top_p=0.0), r"strategy\.top_p=0\.0"),
    ("fdv2", dict(block_size=32, small_block_size=5), r"block_size=32 is not divisible by strategy\.small_block_size"),
    ("fdv2", dict(top_p=1.5), r"strategy\.top_p=1\.5"),
])
def test_bad_settings_name_the_key(name, kw, match):
    S, sc = make("strategy", name, **kw)
    with pytest.raises(ConfigError, match=match):
        S(sc, 32)


def test_sdar_generate_overwrite_option(sdar):
    """generate.py's overwrite of selected non-mask positions (default) against the corrected option: with
    S < B the last steps select already-decoded positions; without overwrite the prompt is never changed."""
    kw = dict(sampler="generate", block_length=8, denoising_steps=2, remasking="low_confidence_static", top_k=1,
              stop_ids=[])
    prompt = [list(range(100, 111))]
    a = run(sdar, "sdar", "block_kv", gen=21, prompts=prompt, **kw)
    b = run(sdar, "sdar", "block_kv", gen=21, prompts=prompt, overwrite=False, **kw)
    assert a != b


@pytest.mark.slow      # (composes and validates every block-diffusion preset: ~3 s on 2 cores)
def test_presets_compose():
    from dlm_engine.app.compose import compose

    for model in ("fast_dllm_v2_1_5b", "fast_dllm_v2_7b", "sdar_1_7b_chat", "sdar_4b_chat", "sdar_8b_chat"):
        cfg = compose([f"model={model}", "strategy=sdar" if "sdar" in model else "strategy=fdv2", "cache=block_kv"])
        assert cfg.model.model_type in ("sdar", "Fast_dLLM_Qwen") and cfg.cache.name == "block_kv"
    cfg = compose(["strategy=sdar", "strategy.sampler=generate", "strategy.remasking=sequential"])
    assert getattr(cfg.strategy.sampler, "value", cfg.strategy.sampler) == "generate"
    assert compose(["strategy=fdv2_batch"]).strategy.name == "fdv2_batch"


# -- the other strategies on block-diffusion models ---------------------------------------------------------------
def test_block_by_block_strategies_run_with_the_model_block_size(sdar, fdv2):
    for lm in (sdar, fdv2):
        bs = lm.model.block_size
        for name, kw in (("threshold", dict(threshold=0.9)), ("low_confidence", dict(steps=32)),
                         ("factor", dict(factor=1.0))):
            out = {}
            for cache in ("none", "prefix"):
                S, sc = make("strategy", name, block_length=bs, **kw)
                C, cc = make("cache", cache)
                canvas = Canvas.from_prompts([list(range(40, 51))], 32, lm.mask_id, lm.pad_id)
                decode(lm.model, canvas, S(sc, 32), cache=C(cc))
                assert not canvas.masked().any()
                out[cache] = canvas.tokens.tolist()
            assert out["none"] == out["prefix"]       # blocks of the model's size: the prefix cache is exact


def test_a_conflicting_block_length_or_a_whole_canvas_strategy_is_refused(sdar):
    S, sc = make("strategy", "threshold", block_length=8)
    canvas = Canvas.from_prompts([[1, 2, 3]], 32, sdar.mask_id, sdar.pad_id)
    with pytest.raises(ConfigError, match=r"strategy\.block_length=8 conflicts with the block size .*sdar: 4"):
        decode(sdar.model, canvas, S(sc, 32))
    W, wc = make("strategy", "wino")
    with pytest.raises(ConfigError, match=r"strategy=wino needs bidirectional attention"):
        decode(sdar.model, canvas, W(wc, 32))


def test_block_kv_pairs_only_with_store_forwards():
    S, sc = make("strategy", "block_buffer", block_length=4)
    C, cc = make("cache", "block_kv")
    assert "store_forwards" in incompatibility(S(sc, 32), C(cc))


def test_sequence_metrics_count_the_last_store_forward(sdar, fdv2):
    """The store forward after a row's last commit is one of its forwards: the row is marked finished after it."""
    S, sc = make("strategy", "sdar", block_length=4, denoising_steps=4, top_k=1, stop_ids=[])
    C, cc = make("cache", "block_kv")
    res = run_prompts(sdar, [list(range(40, 50))], lambda: S(sc, 14), lambda: C(cc), gen_length=14, batch_size=1)
    assert res.rows[0].nfe == 1 + (2 + 1) + 3 * (4 + 1)
    F, fc = make("strategy", "fdv2", block_size=8, small_block_size=4, stop_token=5)     # (greedy: this decode never emits 5)
    res = run_prompts(fdv2, [list(range(40, 50))], lambda: F(fc, 13), lambda: C(cc), gen_length=13, batch_size=1)
    canvas = Canvas.from_prompts([list(range(40, 50))], 13, fdv2.mask_id, fdv2.pad_id)
    decode(fdv2.model, canvas, F(fc, 13), cache=C(cc))
    assert res.rows[0].nfe == canvas.nfe and not canvas.masked().any()


def test_batch_sample_uncached_finish_is_an_option(fdv2):
    """Every row finishing in an uncached first block: the reference raises (reproduced on request), by default
    the decode ends there."""
    from dlm_engine.strategies._block_diffusion import BlockDiffusionError
    from dlm_engine.strategies.fdv2 import batch_canvas, batch_gen_length

    prompt = [808, 908, 545, 699, 513]                      # the fixtures' p0: finishes in its first block
    gen = batch_gen_length([5], 32, 8)
    kw = dict(block_size=8, small_block_size=8, threshold=0.9, stop_token=992, pad_id=990, max_new_tokens=32,
              right_padded=True)
    C, cc = make("cache", "block_kv")
    for flag in (False, True):
        S, sc = make("strategy", "fdv2_batch", uncached_finish_error=flag, **kw)
        canvas = batch_canvas([prompt], gen, fdv2.mask_id, eos_id=fdv2.eos_id)
        if flag:
            with pytest.raises(BlockDiffusionError, match="every row finished in the first block"):
                decode(fdv2.model, canvas, S(sc, gen), cache=C(cc))
        else:
            decode(fdv2.model, canvas, S(sc, gen), cache=C(cc))
            assert canvas.nfe == 2 and 992 in canvas.tokens[0, 5:8].tolist()
