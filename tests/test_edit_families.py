"""Issue 48 items 1 and 6: ``edit`` (LLaDA2.1's M2T + T2T) on the bidirectional families too -- LLaDA (the embedded
tiny model is one) and Dream (shifted logits) -- over the block schedule (blocks of ``strategy.block_length``
aligned to column 0), checked by the rule's properties step by step and, under the caches that refresh every
column at every step, equal to the no-cache decode; and the LLaDA2.1 speed / quality presets."""
import pytest
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.core.capabilities import incompatibility
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import CACHES, load_plugins, strategy_class

from test_dmax import PROMPTS, Steps, decode_with, model

load_plugins()

KW = dict(block_length=8, threshold=0.9, editing_threshold=0.1, max_post_steps=4)
EXACT = {"prefix": {"refresh_interval": 1}, "dual": {"refresh_interval": 1}, "dllm": {"kp": 1, "kr": 1}}


def edit(gen, **kw):
    cls = strategy_class("edit")
    return cls(cls.Config(**{**KW, **kw}), gen)


def prompt_for(family):
    return [5, 9, 13, 21, 7, 30, 11] if family == "llada" else PROMPTS[2][:9]


def run(m, prompt, gen, cache="none", cache_kw=None, **kw):
    return decode_with(edit, m, prompt, gen, cache, cache_kw, **kw)


def check_edit_rule(canvas, rec, threshold, editing_threshold, ntt=1):
    """M2T: the masks above ``threshold`` when at least ``ntt`` are, else the ``ntt`` most confident; T2T: written
    generated positions whose proposal differs, above ``editing_threshold``. Returns the number of edits."""
    g, block = canvas.gen_start, KW["block_length"]
    n_edits = 0
    for d, (masked, tok) in zip(rec.deltas, rec.before):
        s, W = d.start, d.commit.shape[1]
        assert s % block == 0 and W <= block
        mk, commit, conf, new = masked[0, s:s + W], d.commit[0], d.confidence[0].float(), d.tokens[0]
        m2t, t2t = commit & mk, commit & ~mk
        if mk.any():
            high = mk & (conf > threshold)
            if int(high.sum()) >= ntt:
                assert torch.equal(m2t, high)
            else:
                assert int(m2t.sum()) == min(ntt, int(mk.sum()))
                assert float(conf[m2t].min()) >= float(conf[mk & ~m2t].max() if (mk & ~m2t).any() else 0)
        else:
            assert not m2t.any()
        cols = torch.arange(s, s + W)
        want = ~mk & (cols >= g) & (new != tok[0, s:s + W]) & (conf > editing_threshold)
        assert torch.equal(t2t, want)
        n_edits += int(t2t.sum())
    return n_edits


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_edit_runs_on_a_bidirectional_family_over_the_block_schedule(family):
    m = model(family)
    canvas, rec = run(m, prompt_for(family), 24)
    assert check_edit_rule(canvas, rec, KW["threshold"], KW["editing_threshold"]) > 0
    assert not (canvas.tokens[0, canvas.gen_start:] == canvas.mask_id).any()
    opened = [e for d in rec.deltas for e in d.block_events if e.kind == "opened"]
    g = canvas.gen_start                                                         # blocks aligned to column 0:
    assert [e.start for e in opened] == [g] + list(range((g // 8 + 1) * 8, canvas.length, 8))
    assert any(d.scalars.get("post_edit") for d in rec.deltas)                   # post-edit steps ran


def _caches():
    return sorted(c for c, ccls in CACHES.items() if incompatibility(edit(32), ccls()) is None)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_edit_on_a_bidirectional_family_under_its_caches(family):
    """Every cache edit pairs with runs; the ones refreshed at every step decode exactly as no cache does (float64,
    so that two computation paths cannot round a confidence across a threshold differently)."""
    m = model(family, torch.float64)
    prompt = prompt_for(family)
    ref, rec = run(m, prompt, 24)
    edits = check_edit_rule(ref, rec, KW["threshold"], KW["editing_threshold"])
    assert edits > 0
    assert {"none", "prefix", "dual", "dllm", "block_store"} <= set(_caches())
    for cache in _caches():
        got, r = run(m, prompt, 24, cache=cache)
        check_edit_rule(got, r, KW["threshold"], KW["editing_threshold"])
        assert not (got.tokens[0, got.gen_start:] == got.mask_id).any()
        if cache in EXACT:
            exact, _ = run(m, prompt, 24, cache=cache, cache_kw=EXACT[cache])
            assert torch.equal(exact.tokens, ref.tokens) and torch.equal(exact.step_of, ref.step_of)
            assert torch.equal(exact.row_nfe, ref.row_nfe)


def _compose(*overrides):
    from hydra import compose as hcompose, initialize_config_module

    from dlm_engine.app.config import register_configs

    register_configs()
    with initialize_config_module("dlm_engine.conf", version_base="1.3"):
        return hcompose("config", overrides=list(overrides))


@pytest.mark.parametrize("preset, threshold, editing", [("edit", 0.95, 0.9), ("edit_speed", 0.5, 0.0),
                                                         ("edit_quality", 0.95, 0.95)])
def test_llada21_presets(preset, threshold, editing):
    from dlm_engine.app.run import build_strategy

    cfg = _compose(f"strategy={preset}", "strategy.block_length=8", "gen_length=24")
    s = cfg.strategy
    assert (s.name, s.threshold, s.editing_threshold, s.max_post_steps) == ("edit", threshold, editing, 16)
    strategy = build_strategy(cfg)()
    assert strategy.label == preset
    canvas, rec = Canvas.from_prompts([[5, 9, 13]], 24, 3, 2, eos_id=2), Steps()
    with torch.inference_mode():
        decode(model("llada"), canvas, strategy, sinks=[rec])
    check_edit_rule(canvas, rec, threshold, editing)
    assert not (canvas.tokens[0, canvas.gen_start:] == 3).any()


def test_the_dmax_preset_has_the_dmax_scripts_defaults():
    from dlm_engine.app.run import build_strategy

    cfg = _compose("strategy=dmax")
    s = cfg.strategy
    assert (s.name, s.block_length, s.threshold, s.stop_confidence, s.soft_top_k, s.mix) == \
        ("dmax", 32, 0.5, 0.9, 1, "dinfer")
    assert build_strategy(cfg)().label == "dmax"
