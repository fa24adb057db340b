"""The fast layer changes no result: every strategy, with every cache it pairs with, makes the same deltas on the
plain path (``decode(..., fast=False)``: no scored confidences, no host-made first read, finished rows recomputed
from the canvas instead of told from commit counts or taken from the host) as on the fast one -- tokens, commits,
re-masks, finished rows, active rows, block events and NFE, step by step. On :class:`fakes.ScriptedModel` at a real
vocabulary's size (the sampler's scored and ranked paths are taken) and a padded batch of three, with LLaDA's
logits and a shifted model's."""
import pytest
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.core.loop import Sink, decode
from dlm_engine.core.registry import CACHES, cache_class, load_plugins

from fakes import ScriptedModel, random_script
from test_scripted_model import GEN, KNOWN, PROMPTS, V, make, pairs

load_plugins()


class Deltas(Sink):
    """Every delta's observable content, as host values (a delta's tokens count where it commits only)."""

    def __init__(self):
        self.seen = []

    def on_delta(self, delta, canvas):
        rm = delta.remask
        self.seen.append(dict(
            step=delta.step, nfe=delta.nfe, start=delta.start, commit=delta.commit.tolist(),
            tokens=torch.where(delta.commit, delta.tokens, -1).tolist(),
            remask=None if rm is None or not bool(rm.any()) else rm.tolist(),
            finished=None if delta.finished is None else delta.finished.tolist(),
            active=delta.active.tolist(), events=list(delta.block_events)))


def decoded(name, cache, shift, fast):
    strategy = make(name)
    prompts = PROMPTS[:1] if strategy.max_batch == 1 else PROMPTS
    canvas = Canvas.from_prompts(prompts, GEN, V - 1, 0, eos_id=V - 2)
    sink = Deltas()
    with torch.inference_mode():
        decode(ScriptedModel(random_script(seed=5), V, shift=shift), canvas, strategy, cache_class(cache)(),
               sinks=[sink], fast=fast)
    return sink.seen, canvas


@pytest.mark.parametrize("shift", [0, 1], ids=["llada", "shifted"])
@pytest.mark.parametrize("name, cache", pairs())
def test_plain_and_fast_paths_make_the_same_deltas(name, cache, shift):
    if (name, cache, shift) in KNOWN:
        # (sdar + block_kv on the shifted fake does not even repeat itself on the fast path alone: two fast decodes
        # differ from step 7 on -- the known gap reads a store column no call wrote)
        pytest.xfail("a known gap of test_scripted_model (KNOWN)")
    fast, canvas_f = decoded(name, cache, shift, True)
    plain, canvas_p = decoded(name, cache, shift, False)
    assert len(plain) == len(fast) and len(fast) > 0
    for p, f in zip(plain, fast):
        for key in p:
            assert p[key] == f[key], f"{name} + {cache}: step {f['step']} differs in {key}"
    assert canvas_p.nfe == canvas_f.nfe and torch.equal(canvas_p.row_nfe, canvas_f.row_nfe)
    assert torch.equal(canvas_p.tokens, canvas_f.tokens) and torch.equal(canvas_p.step_of, canvas_f.step_of)
    assert torch.equal(canvas_p.finished, canvas_f.finished)


def test_every_cache_is_paired_with_some_strategy():
    """The comparison above covers every registered cache (a cache no strategy pairs with would be unchecked)."""
    assert {c for _, c in pairs()} == set(CACHES.names())


def test_the_plain_path_takes_none_of_the_shortcuts():
    """``fast=False`` is not the fast path under another name: the loop's sampler computes confidences at every
    position of the window (no ``-inf`` outside the masked ones, where the fast path scores the masked positions
    only), and a strategy's fast mixins are off: the policy's own methods run."""
    from dlm_engine.core.fast.layer import FastLayer

    seen = {}

    class Marked(FastLayer, type(make("threshold"))):     # a fast mixin that marks the deltas it made
        def select(self, canvas, plan, proposal, st):
            delta, st = super().select(canvas, plan, proposal, st)
            if self.fast_on:
                delta.scalars["fast"] = 1
            return delta, st

    class Probe(Sink):
        def __init__(self, key):
            self.key = key
            seen[key] = []

        def on_delta(self, delta, canvas):
            if delta.nfe:
                seen[self.key].append(("fast" in delta.scalars, bool(torch.isinf(delta.confidence).any())))

    for fast in (True, False):
        strategy = Marked(make("threshold").cfg, GEN)
        canvas = Canvas.from_prompts(PROMPTS, GEN, V - 1, 0, eos_id=V - 2)
        with torch.inference_mode():
            decode(ScriptedModel(random_script(seed=5), V), canvas, strategy, cache_class("none")(),
                   sinks=[Probe(fast)], fast=fast)
        assert strategy.fast_on          # (the plain decode ran a copy)
    assert seen[False] and all(not marked and not inf for marked, inf in seen[False])
    assert all(marked for marked, _ in seen[True]) and any(inf for _, inf in seen[True])


def test_the_plain_delta_takes_six_keywords_and_plans_carry_typed_data():
    """``Strategy.delta`` is the plain rule (the count shortcuts live in ``core/fast``), and what a plan hands its
    select is a dataclass, not a dict (``StepPlan.info`` is gone)."""
    import dataclasses
    import inspect

    from dlm_engine.core.strategy import StepPlan, Strategy

    kw = [p.name for p in inspect.signature(Strategy.delta).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert len(kw) <= 6 and not {"masked_left", "committed", "committed_host", "finished_counts"} & set(kw)
    assert "info" not in StepPlan.__dataclass_fields__
    seen = []

    class Plans(type(make("low_confidence"))):
        def plan(self, canvas, st):
            p, st = super().plan(canvas, st)
            seen.append(None if p is None else p.data)
            return p, st

    strategy = Plans(make("low_confidence").cfg, GEN)
    canvas = Canvas.from_prompts(PROMPTS, GEN, V - 1, 0)
    with torch.inference_mode():
        decode(ScriptedModel(random_script(), V), canvas, strategy, cache_class("none")())
    data = [d for d in seen if d is not None]
    assert data and all(dataclasses.is_dataclass(d) and type(d).__name__ == "TransferPlan" for d in data)


@pytest.mark.slow   # ~2 s (two models' decodes through the API): in-process but seconds long: kept out of the quick tier (CI runs it)
def test_the_run_option_fast_false_reaches_the_loop_and_decodes_the_same(monkeypatch):
    """``fast=false`` (``dlm``, the Python API, lm-eval, dlm-serve: a RunConfig key) runs the loop's plain path;
    the rows are those of the default fast path, and the default keeps a sweep job's config digest."""
    import dlm_engine
    from dlm_engine.app import api
    from dlm_engine.app.compose import compose
    from dlm_engine.app.jobs import config_digest
    from omegaconf import OmegaConf

    seen, real = [], api.decode

    def spy(*a, **k):
        seen.append(k.get("fast", True))
        return real(*a, **k)

    monkeypatch.setattr(api, "decode", spy)
    s = dlm_engine.Session(model="tiny", device="cpu")
    P = ["347+085=", "901-256=", "name a fruit:"]
    for strategy, cache in (("threshold", "dual"), ("d2c", "d2cache")):
        seen.clear()
        fast = s.generate(P, strategy=strategy, cache=cache, batch_size=3)
        plain = s.generate(P, strategy=strategy, cache=cache, batch_size=3, fast=False)
        assert seen == [True, False]
        for a, b in zip(fast.rows, plain.rows):
            assert (a.text, a.tokens, a.step_of, a.nfe) == (b.text, b.tokens, b.step_of, b.nfe)
    default, off = compose([]), compose(["fast=false"])
    assert default.fast is True and off.fast is False
    without = OmegaConf.create(OmegaConf.to_container(default))
    del without["fast"]
    assert config_digest(default) == config_digest(without) != config_digest(off)
