"""Strategies are pure policies: ``plan`` twice on the same state gives the same plan; neither ``plan`` nor
``select`` mutates the canvas, the proposal, the state passed in or the strategy object; set-up changes to
the canvas arrive as a step-0 delta."""
import copy
import dataclasses

import pytest
import numpy as np
import torch

from dlm_engine.core.canvas import Canvas, FrameDelta
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import STRATEGIES, cache_class, load_plugins, strategy_class
from dlm_engine.core.strategy import Strategy
from dlm_engine.app.sinks import RecordingSink

PROMPTS = [[735, 559, 771, 678, 375, 377], [127, 157, 983, 804, 991, 537, 902, 490, 136]]
GEN = 16

load_plugins()

SETTINGS = {
    "early_exit": dict(answer_start=4, constraints=[[2, 5]], block_length=8),
    "dream": dict(steps=8),
    "cadllm": dict(initial_block_length=8, min_block=4, max_block=8),
    "block_buffer": dict(block_length=4, buffer_size=2),
}


def snapshot(x):
    """A comparable deep copy of a value made of dataclasses, tuples, lists, dicts and tensors."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.detach().clone())
    if isinstance(x, np.ndarray):
        return ("tensor", torch.from_numpy(x.copy()))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, {f.name: snapshot(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [snapshot(v) for v in x])
    if isinstance(x, dict):
        return ("dict", {k: snapshot(v) for k, v in x.items()})
    return copy.deepcopy(x)


def same(a, b) -> bool:
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "tensor":
        return isinstance(b, tuple) and b[0] == "tensor" and a[1].shape == b[1].shape and a[1].dtype == b[1].dtype \
            and bool(torch.equal(torch.nan_to_num(a[1].float(), 1e9), torch.nan_to_num(b[1].float(), 1e9)))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


class Checked(Strategy):
    """Wraps a strategy; at every step checks purity of plan and select."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.offers, self.needs = inner.name, inner.offers, inner.needs
        self.steps = 0

    def prepare(self, canvas):
        return self.inner.prepare(canvas)

    def init_state(self, canvas):
        self.attrs = snapshot({k: v for k, v in vars(self.inner).items()})
        return self.inner.init_state(canvas)

    def max_steps(self, canvas):
        return self.inner.max_steps(canvas)

    def reads(self, canvas, state):
        st0 = snapshot(state)
        req = self.inner.reads(canvas, state)
        assert same(snapshot(state), st0), f"{self.name}: reads mutated the state"
        return req

    def settle(self, canvas, state, values, delta):
        st0 = snapshot(state)
        new = self.inner.settle(canvas, state, values, delta)
        assert same(snapshot(state), st0), f"{self.name}: settle mutated the state passed in"
        return new

    def _canvas(self, canvas):
        return snapshot([canvas.tokens, canvas.step_of, canvas.finished, canvas.step])

    def plan(self, canvas, state):
        before, st0 = self._canvas(canvas), snapshot(state)
        p1, s1 = self.inner.plan(canvas, state)
        assert same(snapshot(state), st0), f"{self.name}: plan mutated the state passed in"
        p2, s2 = self.inner.plan(canvas, state)
        assert same(snapshot(p1), snapshot(p2)), f"{self.name}: plan is not idempotent"
        assert same(snapshot(s1), snapshot(s2)), f"{self.name}: plan's new state differs between two calls"
        assert same(self._canvas(canvas), before), f"{self.name}: plan mutated the canvas"
        return p1, s1

    def select(self, canvas, plan, proposal, state):
        before, st0, prop0 = self._canvas(canvas), snapshot(state), snapshot(proposal)
        delta, new = self.inner.select(canvas, plan, proposal, state)
        assert same(snapshot(state), st0), f"{self.name}: select mutated the state passed in"
        assert same(snapshot(proposal), prop0), f"{self.name}: select mutated the proposal"
        assert same(self._canvas(canvas), before), f"{self.name}: select mutated the canvas"
        assert same(snapshot({k: v for k, v in vars(self.inner).items()}), self.attrs), \
            f"{self.name}: select changed the strategy object"
        self.steps += 1
        return delta, new


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_plan_and_select_are_pure(tiny_llada, name):
    cls = strategy_class(name)
    kw = SETTINGS.get(name, {})
    prompts = PROMPTS[:1] if cls.max_batch == 1 or getattr(cls, "unpadded_only", False) else PROMPTS
    canvas = Canvas.from_prompts(prompts, GEN, 1000, 1001)
    strategy = Checked(cls(cls.Config(**kw), GEN))
    rec = RecordingSink()
    decode(tiny_llada, canvas, strategy, cache=cache_class("none")(), sinks=[rec])
    assert strategy.steps > 0 and not canvas.masked()[:, canvas.gen_start:].any()


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_plan_and_select_are_pure_where_every_fast_path_is_taken(name):
    """As above, at a real vocabulary's size (50,000: the sampler scores the masked positions only and ranks by
    chunked maxima) and a padded batch of three whose rows finish at different steps (host counts, counted
    finished rows, rows sitting steps out), on :class:`fakes.ScriptedModel`: the proposal a fast path hands to
    ``select`` (``Proposal.masked`` included) must come back as it went in."""
    from fakes import ScriptedModel, random_script

    V = 50_000
    cls = strategy_class(name)
    kw = dict(SETTINGS.get(name, {}))
    if name == "sdar":
        kw.update(temperature=1.0, top_k=1)         # (SDAR has no greedy mode: top-1 sampling is one)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16]]
    prompts = prompts[:1] if cls.max_batch == 1 or getattr(cls, "unpadded_only", False) else prompts
    canvas = Canvas.from_prompts(prompts, GEN, V - 1, 0, eos_id=V - 2)
    strategy = Checked(cls(cls.Config(**kw), GEN))
    decode(ScriptedModel(random_script(seed=2), V), canvas, strategy, cache=cache_class("none")())
    assert strategy.steps > 0 and not canvas.masked()[:, canvas.gen_start:].any()


def test_setup_is_a_step_zero_delta_that_replays(tiny_llada):
    """Constraints are not written into the canvas by the strategy: the loop applies the step-0 delta and
    every sink sees it, so the state before step 1 can be rebuilt from the deltas alone."""
    cls = strategy_class("early_exit")
    canvas = Canvas.from_prompts(PROMPTS, GEN, 1000, 1001)
    initial = canvas.tokens.clone()
    strategy = cls(cls.Config(constraints=[[0, 7], [5, 9]]), GEN)
    assert strategy.prepare(canvas) is not None and torch.equal(canvas.tokens, initial)   # prepare is pure
    rec = RecordingSink()
    decode(tiny_llada, canvas, strategy, sinks=[rec])
    d0 = rec.deltas[0]
    assert isinstance(d0, FrameDelta) and d0.step == 0 and d0.nfe == 0
    replay = initial.clone()
    s = d0.start
    replay[:, s:s + d0.width] = torch.where(d0.commit, d0.tokens, replay[:, s:s + d0.width])
    g = canvas.gen_start
    assert replay[:, g].tolist() == [7, 7] and replay[:, g + 5].tolist() == [9, 9]
    assert canvas.step_of[:, g].tolist() == [0, 0]


def test_delta_with_remask_derives_finished(tiny_llada):
    """``Strategy.delta(remask=...)``: a row whose last mask is committed while another position is re-masked
    is not finished; a row whose remask is undone by a commit in the same delta is."""
    canvas = Canvas.from_prompts([[1, 2], [3, 4]], 3, 9, 0)
    g = canvas.gen_start
    canvas.tokens[:, g:g + 2] = 5
    canvas.step_of[:, g:g + 2] = 1
    canvas.step = 1
    from dlm_engine.core.sampler import Proposal

    prop = Proposal(start=g, x0=torch.full((2, 3), 6), confidence=torch.ones(2, 3), logits=torch.zeros(2, 3, 10))
    commit = torch.tensor([[False, False, True], [True, False, True]])
    remask = torch.tensor([[True, False, False], [True, False, False]])
    d = Strategy.delta(canvas, prop, commit, remask=remask)
    assert d.finished.tolist() == [False, True]
    assert Strategy.delta(canvas, prop, commit).finished.tolist() == [True, True]
    canvas.apply(d)
    assert canvas.masked()[:, g:].tolist() == [[True, False, False], [False, False, False]]


def test_evolve_copies_and_rejects_unknown_fields():
    """``evolve`` (the states' fast ``dataclasses.replace``) leaves the old state alone and refuses a misspelt
    field instead of adding an attribute."""
    import pytest

    from dlm_engine.core.strategy import BlockCursor, evolve
    from dlm_engine.strategies.low_confidence import Schedule

    st = Schedule(counts=((1, 2),))
    new = evolve(st, cursor=BlockCursor(1, 0))
    assert new.cursor == BlockCursor(1, 0) and new.counts == ((1, 2),) and st.cursor == BlockCursor()
    assert new == Schedule(cursor=BlockCursor(1, 0), counts=((1, 2),))
    with pytest.raises(TypeError, match="curser"):
        evolve(st, curser=BlockCursor(1, 0))
