"""prefix and dual KV caches: reference parity (every cached fastdllm_v2.json case: tokens, NFE, unmask
steps and the shape of every model call), the prefix cache's wasted draw, exactness when every step
refreshes, refresh intervals, left-padded batches, CFG's doubled batch, validation and the CLI."""
import json

import pytest
import torch

from conftest import REFPARITY, compare_with_reference, fixture_ids, record_calls, run_dlm
from dlm_engine.core import sampler
from dlm_engine.core.canvas import Canvas
from dlm_engine.errors import ConfigError
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import cache_class, strategy_class

PROMPTS = [[735, 559, 771, 678, 375, 377], [127, 157, 983, 804, 991, 537, 902, 490, 136, 103, 962], [413, 750, 0]]
CACHED = ("generate_with_prefix_cache", "generate_with_dual_cache")


def make_cache(name, **kw):
    cls = cache_class(name)
    return cls(cls.Config(**kw))


def run(model, name, prompts, cache="none", gen=32, seed=None, cache_kw=None, **kw):
    cls = strategy_class(name)
    canvas = Canvas.from_prompts(prompts, gen, 1000, 1001)
    c = make_cache(cache, **(cache_kw or {}))
    calls = record_calls(c) if cache != "none" else []
    if seed is not None:
        torch.manual_seed(seed)
    decode(model, canvas, cls(cls.Config(**kw), gen), cache=c)
    return canvas, calls


@pytest.mark.slow
@pytest.mark.parity
def test_every_cached_fastdllm_case_matches(parity, tiny_llada, tmp_path):
    ids = fixture_ids("fastdllm_v2", lambda c: c["function"] in CACHED)
    assert len(ids) >= 12
    data = json.loads((REFPARITY / "fastdllm_v2.json").read_text())
    cands = {c["id"]: parity.run_case(c, data["prompts"], tiny_llada, 1000, 1001) for c in data["cases"] if c["id"] in ids}
    code, out = compare_with_reference(cands, ids, tmp_path)
    assert code == 0, out
    assert f"{len(ids)} match, 0 mismatch" in out


def test_model_calls_have_the_reference_shapes(parity, tiny_llada):
    """Refresh = full call on L columns; prefix cached call = [s, L); dual cached call = [s, e)."""
    data = json.loads((REFPARITY / "fastdllm_v2.json").read_text())
    n = 0
    for case in data["cases"]:
        if case["function"] not in CACHED or "error" in case:
            continue
        strategy, cache, setup = parity.build(case)
        gen = setup.gen_length
        calls = record_calls(cache)
        canvas = Canvas.from_prompts([data["prompts"][case["prompt_idx"]]], gen, 1000, 1001)
        decode(tiny_llada, canvas, strategy, cache=cache)
        kinds = []
        for refresh, (a, b), batch in calls:
            kind = "full" if refresh else cache.name
            if kinds and kinds[-1][:3] == [kind, b - a, batch]:
                kinds[-1][3] += 1
            else:
                kinds.append([kind, b - a, batch, 1])
        assert kinds == case["forwards"], case["id"]
        n += 1
    assert n >= 12


@pytest.mark.parametrize("cache, wasted", [("prefix", True), ("prefix", False), ("dual", False)])
def test_gumbel_draws_follow_the_reference(tiny_llada, monkeypatch, cache, wasted):
    """At T > 0: one (1, L, V) draw at a refresh; cached prefix steps draw (1, L-s, V) twice (one wasted)."""
    shapes = []
    real = sampler.noise_draw

    def spy(shape, device):
        shapes.append(tuple(shape))
        return real(shape, device)

    monkeypatch.setattr(sampler, "noise_draw", spy)
    kw = {"wasted_draw": wasted} if cache == "prefix" else {}
    canvas, calls = run(tiny_llada, "threshold", PROMPTS[:1], cache, seed=5, cache_kw=kw, threshold=0.8,
                        block_length=8, temperature=0.7)
    expected = []
    for refresh, (a, b), _ in calls:
        expected += [(1, b - a, 1024)] * (1 if refresh or not wasted else 2)
    assert shapes == expected
    assert any(not r for r, _, _ in calls)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("name, kw", [
    ("low_confidence", dict(steps=16, block_length=8, loop="fastdllm")),
    ("threshold", dict(threshold=0.8, block_length=8)),
    ("threshold", dict(threshold=0.7, block_length=8, temperature=0.8)),
    ("low_confidence", dict(steps=16, block_length=8, cfg_scale=1.5)),
])
def test_refreshing_every_step_equals_no_cache_exactly(tiny_llada, cache, name, kw):
    """refresh_interval=1 still routes every K/V through the cache storage, and is exactly uncached."""
    ref, _ = run(tiny_llada, name, PROMPTS, "none", seed=3, **kw)
    got, calls = run(tiny_llada, name, PROMPTS, cache, seed=3, cache_kw={"refresh_interval": 1}, **kw)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.step_of, ref.step_of)
    assert got.nfe == ref.nfe == len(calls)
    assert all(r and span == (0, got.length) for r, span, _ in calls)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_refresh_interval(tiny_llada, cache):
    for n in (2, 3):
        _, calls = run(tiny_llada, "low_confidence", PROMPTS[:1], cache, gen=16, cache_kw={"refresh_interval": n},
                       steps=16, block_length=16, loop="fastdllm")
        assert [r for r, _, _ in calls] == ([True] + [False] * (n - 1)) * (16 // n) + [True] * (16 % n)
    _, calls = run(tiny_llada, "low_confidence", PROMPTS[:1], cache, gen=16, steps=16, block_length=8,
                   loop="fastdllm")
    assert [r for r, _, _ in calls] == ([True] + [False] * 7) * 2          # default: block starts only


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("name, kw", [("threshold", dict(threshold=0.8, block_length=8)),
                                      ("low_confidence", dict(steps=16, block_length=8, loop="fastdllm"))])
def test_left_padded_batch_rows_equal_rows_alone(tiny_llada, cache, name, kw):
    """The key padding mask covers cached keys and position ids come from the canvas."""
    batch, calls = run(tiny_llada, name, PROMPTS, cache, **kw)
    assert batch.is_padded and any(not r for r, _, _ in calls)
    g = batch.gen_start
    for r, p in enumerate(PROMPTS):
        one, _ = run(tiny_llada, name, [p], cache, **kw)
        # (step numbers may differ: a batch moves to the next block when every row has filled this one)
        assert torch.equal(batch.tokens[r, g:], one.tokens[0, one.gen_start:])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cfg_doubles_the_cached_batch(tiny_llada, cache):
    canvas, calls = run(tiny_llada, "low_confidence", PROMPTS, cache, steps=16, block_length=8, cfg_scale=1.0)
    assert not canvas.masked().any()
    assert {b for _, _, b in calls} == {6}
    assert any(not r for r, _, _ in calls)


def test_the_cache_is_a_plain_call_without_directive(tiny_llada):
    x = torch.tensor([PROMPTS[0] + [1000] * 8])
    c = make_cache("dual")
    with torch.no_grad():
        plain = tiny_llada(x).logits
        via = tiny_llada(x, hooks=c).logits
    assert torch.equal(plain, via) and not c.k


@pytest.mark.parametrize("name", ["prefix", "dual"])
def test_bad_refresh_interval_names_the_key(name):
    with pytest.raises(ConfigError, match=r"cache\.refresh_interval=-1"):
        make_cache(name, refresh_interval=-1)


@pytest.mark.slow
def test_cli_runs_a_cached_strategy(tmp_path):
    proc = run_dlm([f"hydra.run.dir={tmp_path / 'run'}", "device=cpu", "trace.record=false", "strategy=threshold",
                    "strategy.block_length=8", "cache=prefix", "cache.refresh_interval=2", "gen_length=16"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["cache"] == {"name": "prefix", "refresh_interval": 2, "wasted_draw": True, "shifted": "extend"}
