"""Model-free unit tests of every strategy and every cache, on :class:`fakes.ScriptedModel` (chosen logits at any
vocabulary and batch, through the real cache hooks): the quick tier's cover for what the parity suites check on
real checkpoints."""
import pytest
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.core.capabilities import incompatibility
from dlm_engine.core.loop import decode
from dlm_engine.core.protocol import CallRequest
from dlm_engine.core.registry import CACHES, STRATEGIES, cache_class, load_plugins, strategy_class

from fakes import ScriptedModel, preferring, random_script

load_plugins()

V = 50_000              # a real vocabulary's size: the scored/ranked fast paths of the sampler are taken
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16]]
GEN = 16
SETTINGS = {
    "early_exit": dict(answer_start=4, block_length=8),
    "dream": dict(steps=8, block_length=8),
    "cadllm": dict(initial_block_length=8, min_block=4, max_block=8),
    "block_buffer": dict(block_length=4, buffer_size=2),
    "sdar": dict(block_length=8, temperature=1.0, top_k=1),      # SDAR has no greedy mode: top-1 sampling is one
}


# strategies that rewrite written tokens (T2T edits): the script depends on the token a column holds, so an edit
# moves a column off the argmax of the masked canvas by design; they are checked for an unmasked end and, under
# every cache, for the trajectory of the uncached decode
EDITING = {"edit", "dmax"}
# a strategy with blocks aligned at column 0 on a shifted-logit model under block_store: the first generated
# column's logits come from the prompt's last column, which the store has frozen (known gap, issue 45 notes)
# (the real shifted block-diffusion model, Fast-dLLM v2, shifts within the queried block instead: parity suites)
KNOWN = {(n, c, 1) for n in ("llada2", "edit", "fdv2", "fdv2_batch", "sdar") for c in ("block_store", "block_kv")}


def make(name):
    cls = strategy_class(name)
    kw = dict(SETTINGS.get(name, {}))
    if not kw and "block_length" in cls.Config.__dataclass_fields__:
        kw["block_length"] = 8
    return cls(cls.Config(**kw), GEN)


def pairs():
    return [(name, cache) for name in STRATEGIES.names() for cache, ccls in CACHES.items()
            if incompatibility(make(name), ccls()) is None]


def run(model, name, cache, vocab=V):
    strategy = make(name)
    prompts = PROMPTS[:1] if strategy.max_batch == 1 else PROMPTS
    canvas = Canvas.from_prompts(prompts, GEN, vocab - 1, 0, eos_id=vocab - 2)
    with torch.inference_mode():
        decode(model, canvas, strategy, cache_class(cache)())
    return canvas


def script_argmax(script, canvas, vocab=V):
    """The token the script prefers at every generation column of a still masked canvas."""
    B, g = canvas.batch_size, canvas.gen_start
    rows, cols = torch.arange(B).repeat_interleave(GEN), torch.arange(g, g + GEN).repeat(B)
    return script(rows, cols, torch.full_like(rows, vocab - 1), vocab).argmax(-1).view(B, GEN)


@pytest.mark.parametrize("vocab, batch, shift", [(12, 1, 0), (1000, 3, 0), (V, 2, 1)])
def test_the_logits_are_the_scripts(vocab, batch, shift):
    script = random_script(seed=3, by_row=True)
    model = ScriptedModel(script, vocab, shift=shift)
    ids = torch.randint(0, vocab, (batch, 10))
    call = model(ids, logits_range=(4, 9))
    assert call.logits.shape == (batch, 5, vocab) and call.valid is None
    rows, cols = torch.arange(batch).repeat_interleave(5), torch.arange(4, 9).repeat(batch)
    want = script(rows, cols, ids[:, 4:9].reshape(-1), vocab).view(batch, 5, vocab)
    assert torch.equal(call.logits, want)
    assert model.calls == 1 and model.sizes == [batch] and model.computed == batch * 10


def test_a_call_over_some_rows_gets_those_rows_scripts():
    script = random_script(by_row=True)
    model = ScriptedModel(script, 100)
    ids = torch.randint(0, 100, (2, 6))
    call = model(ids, logits_range=(2, 6), request=CallRequest(rows=torch.tensor([1, 4]), full_batch=5))
    rows, cols = torch.tensor([1, 4]).repeat_interleave(4), torch.arange(2, 6).repeat(2)
    assert torch.equal(call.logits, script(rows, cols, ids[:, 2:].reshape(-1), 100).view(2, 4, 100))


def test_preferences_script():
    at = preferring([[3, 4], [5, 6]], [[0.9, 0.5], [0.7, 0.6]], second=[[1, 1], [2, 2]])
    out = at(2)(torch.tensor([0, 1, 1, 0]), torch.tensor([2, 3, 9, 0]), torch.zeros(4, dtype=torch.long), 8)
    p = out.softmax(-1)
    assert out.argmax(-1)[:2].tolist() == [3, 6] and p[0, 3] > 0.85 and p[1, 6] > 0.55
    assert torch.equal(out[2], out[3]) and (out[2] == -8.0).all()      # outside the generation: flat


@pytest.mark.parametrize("shift", [0, 1], ids=["llada", "shifted"])
@pytest.mark.parametrize("name, cache", pairs())
def test_every_strategy_with_every_cache_decodes_the_script(name, cache, shift):
    """The fake is exact under every cache (its layers add nothing), so each pair must finish on the script's
    preferred tokens along the very trajectory it takes without a cache: a cache that misplaces columns or
    rows, marks computed columns invalid (or the reverse), or a strategy that loses or repeats a column, shows
    here in a fraction of a second, with LLaDA's logits and with a shifted-logit model's (Dream: the span caches
    recompute one more column). (Staleness itself needs a real model: the parity suites.)"""
    if (name, cache, shift) in KNOWN:
        pytest.xfail("a known gap (see KNOWN)")
    script = random_script()
    model = ScriptedModel(script, V, shift=shift)
    canvas = run(model, name, cache)
    assert not canvas.masked()[:, canvas.gen_start:].any()
    if name not in EDITING:
        assert torch.equal(canvas.tokens[:, canvas.gen_start:], script_argmax(script, canvas))
    if cache != "none":
        alone = run(ScriptedModel(script, V, shift=shift), name, "none")
        assert torch.equal(canvas.step_of, alone.step_of) and torch.equal(canvas.row_nfe, alone.row_nfe)


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_every_strategy_at_a_small_vocabulary(name):
    script, vocab = random_script(seed=1), 64
    canvas = run(ScriptedModel(script, vocab), name, "none", vocab)
    assert not canvas.masked()[:, canvas.gen_start:].any()
    if name not in EDITING:
        assert torch.equal(canvas.tokens[:, canvas.gen_start:], script_argmax(script, canvas, vocab))
    assert int(canvas.nfe) >= 1


@pytest.mark.parametrize("cache", [c for c in CACHES.names() if c != "none"])
def test_every_cache_computes_fewer_positions(cache):
    order = {"low_confidence": 0, "sdar": 1}        # fdv2's uncached forwards already stop at the block's end
    name = next(n for n, c in sorted(pairs(), key=lambda p: order.get(p[0], 2)) if c == cache)
    full, cached = ScriptedModel(random_script(), V), ScriptedModel(random_script(), V)
    run(full, name, "none")
    run(cached, name, cache)
    assert cached.calls == full.calls and 0 < cached.layer_positions < full.layer_positions, name


def test_low_confidence_commits_the_most_confident_column_first():
    conf = [0.6, 0.95, 0.7, 0.75, 0.55, 0.9, 0.65, 0.8] * 2
    top = list(range(10, 26))
    canvas = Canvas.from_prompts([[5, 6]], GEN, 99, 0)
    cls = strategy_class("low_confidence")
    decode(ScriptedModel(preferring(top, conf)(canvas.gen_start), 100), canvas,
           cls(cls.Config(block_length=8, steps=GEN), GEN), cache_class("none")())
    g = canvas.gen_start
    assert canvas.tokens[0, g:].tolist() == top
    first = canvas.step_of[0, g:g + 8].tolist()
    assert sorted(range(8), key=lambda j: first[j]) == sorted(range(8), key=lambda j: -conf[j])


def test_threshold_commits_every_column_above_it_in_one_step():
    conf = [0.97, 0.3, 0.98, 0.4, 0.99, 0.2, 0.96, 0.5] + [0.99] * 8
    canvas = Canvas.from_prompts([[5, 6]], GEN, 99, 0)
    cls = strategy_class("threshold")
    decode(ScriptedModel(preferring(list(range(10, 26)), conf)(canvas.gen_start), 100), canvas,
           cls(cls.Config(block_length=8, threshold=0.9), GEN), cache_class("none")())
    g = canvas.gen_start
    assert [j for j in range(8) if canvas.step_of[0, g + j] == 1] == [0, 2, 4, 6]
    assert set(canvas.step_of[0, g + 8:].tolist()) == {int(canvas.step_of[0, g:g + 8].max()) + 1}


def test_ar_commits_left_to_right():
    canvas = Canvas.from_prompts([[5, 6, 7]], GEN, 99, 0)
    cls = strategy_class("ar")
    decode(ScriptedModel(preferring(list(range(10, 26)), [0.6] * GEN)(canvas.gen_start), 100), canvas,
           cls(cls.Config(block_length=8), GEN), cache_class("none")())
    steps = canvas.step_of[0, canvas.gen_start:].tolist()
    assert steps == sorted(steps) and canvas.tokens[0, canvas.gen_start:].tolist() == list(range(10, 26))
