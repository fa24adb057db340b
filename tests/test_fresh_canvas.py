"""A fresh canvas (made by ``Canvas.from_prompts`` and not changed since: ``core/fast/mirror.py: is_fresh``) has
every generated position masked and no row finished, so the host read before the first step can be made on the host
(``Strategy.fresh_values``). The values equal what the device read returns, for every strategy and setting that
offers them; the decode reads one time fewer and is otherwise the same, bit for bit."""
import pytest
import torch

from dlm_engine.core.canvas import Canvas, FrameDelta
from dlm_engine.core.fast.mirror import HostMirror, is_fresh
from dlm_engine.core.loop import decode, sync_round
from dlm_engine.core.registry import STRATEGIES, cache_class, load_plugins, strategy_class

load_plugins()

PROMPTS = [[735, 559, 771, 678, 375, 377], [127, 157, 983, 804, 991, 537, 902, 490, 136]]
MASK, PAD = 1000, 1001

# (strategy, config, generation length); block_buffer's last block is shorter
SETTINGS = [(name, kw, gen) for name in STRATEGIES.names() for kw, gen in [({}, 16)]] + [
    ("low_confidence", dict(block_length=4, steps=8), 16),
    ("threshold", dict(block_length=4), 16),
    ("factor", dict(block_length=8), 24),
    ("early_exit", dict(block_length=8), 16),
    ("early_exit", dict(block_length=8, constraints=[[2, 5]]), 16),       # a set-up delta: not fresh any more
    ("block_buffer", dict(block_length=6, buffer_size=2), 16),
    ("d2c", dict(block_length=4, stop_until_eos=True), 16),
    ("d2c", dict(block_length=8, gamma=0.01), 16),                        # (EB's entropy budget)
    ("d2c", dict(block_length=8, sigma=10.0, eos_fill=True), 16),         # (the certainty prior)
    ("klass", dict(block_length=8), 16),
    ("wino", dict(block_length=8, shrinking_window=True), 16),
    ("cadllm", dict(initial_block_length=8, min_block=4, max_block=8), 16),
]
# the strategies that must make the read on the host (a strategy dropping out fails; PC-Sampler, EB and the
# certainty prior are d2c presets, covered by d2c's settings)
OFFER = {"low_confidence", "threshold", "factor", "early_exit", "block_buffer", "d2c", "klass", "ar", "wino",
         "cadllm"}


def test_the_offering_strategies_are_registered():
    assert OFFER <= set(STRATEGIES.names())


def build(name, kw, gen):
    cls = strategy_class(name)
    kw = dict(kw)
    if name == "dream" and not kw:
        kw["steps"] = 8
    return cls(cls.Config(**kw), gen), PROMPTS[:1] if cls.max_batch == 1 else PROMPTS


@pytest.mark.parametrize("name, kw, gen", SETTINGS)
def test_fresh_values_are_what_the_device_read_returns(name, kw, gen):
    strategy, prompts = build(name, kw, gen)
    canvas = Canvas.from_prompts(prompts, gen, MASK, PAD, eos_id=1002)
    assert is_fresh(canvas)
    setup = strategy.prepare(canvas)
    if setup is not None:
        canvas.apply(setup)
        assert not is_fresh(canvas)
    state = strategy.init_state(canvas)
    values = strategy.fresh_values(canvas, state) if is_fresh(canvas) else None
    if values is None:
        assert setup is not None or name not in OFFER, f"{name} {kw}: no host values on a fresh canvas"
        return
    host, _ = sync_round(canvas, HostMirror(canvas.batch_size), strategy, state, None)
    assert host.finished == (False,) * canvas.batch_size
    assert len(values) == len(host.values) and all(a == b and type(a) is type(b) for a, b in zip(values, host.values))


def test_is_fresh_until_anything_changes_the_canvas():
    def fresh():
        return Canvas.from_prompts(PROMPTS, 8, MASK, PAD)

    assert is_fresh(fresh())
    for edit in (lambda c: c.step_of[0, -1].fill_(3), lambda c: c.tokens[:, -2:].fill_(7),
                 lambda c: c.finished.fill_(True), lambda c: setattr(c, "step_of", c.step_of.clone()),
                 lambda c: c.step_of.add_(0)):
        c = fresh()
        edit(c)
        assert not is_fresh(c)
    c = fresh()
    B, W = c.batch_size, c.gen_length
    c.apply(FrameDelta(step=0, nfe=0, start=c.gen_start, commit=torch.zeros(B, W, dtype=torch.bool),
                       tokens=torch.zeros(B, W, dtype=torch.long), active=torch.ones(B, dtype=torch.bool),
                       finished=torch.zeros(B, dtype=torch.bool)))
    assert not is_fresh(c)                     # an empty set-up delta too: the canvas tensors were written
    with torch.inference_mode():                # inference tensors keep no version counter: never fresh
        assert not is_fresh(fresh())


@pytest.mark.parametrize("name, kw", [("low_confidence", {}), ("threshold", dict(block_length=8)),
                                      ("block_buffer", dict(block_length=4, buffer_size=2)),
                                      ("d2c", dict(block_length=8)), ("cadllm", {}), ("wino", dict(block_length=8)),
                                      ("early_exit", dict(block_length=8))])
def test_a_fresh_canvas_decodes_with_one_read_fewer_and_the_same_tokens(tiny_llada, name, kw):
    outs = []
    for touch in (False, True):
        strategy, prompts = build(name, kw, 16)
        reads = []

        class Counted(type(strategy)):
            def sync_request(self, canvas, st):
                reads.append(canvas.step)
                return super().sync_request(canvas, st)

        strategy.__class__ = Counted
        canvas = Canvas.from_prompts(prompts, 16, MASK, PAD)
        if touch:
            canvas.step_of.add_(0)              # the same values, but no longer known to be fresh
        torch.manual_seed(0)
        with torch.inference_mode():
            decode(tiny_llada, canvas, strategy, cache_class("none")())
        outs.append((canvas.tokens.clone(), canvas.step_of.clone(), canvas.step, reads))
    (t0, s0, n0, r0), (t1, s1, n1, r1) = outs
    assert torch.equal(t0, t1) and torch.equal(s0, s1) and n0 == n1
    assert r1 == [0] + r0 and 0 not in r0 and len(r0) == n0
