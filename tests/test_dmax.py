"""Issue 48 item 3: ``dmax`` (DMax soft parallel decoding, shared/specs/edit_decoding.md section 3) and the model
seam it needs (``CallRequest.soft``: input embeddings mixed from token and mask embeddings at chosen columns).

The seam: on every bundled family, soft inputs one-hot on a token give the plain forward of that token, and a
mask mixture reaches the first layer norm-rescaled as the spec says; a model that does not offer the seam is
refused in one line. The rule, by its properties on the tiny fixture models: M2T commits only a confident
left-to-right prefix (else the leftmost mask), every written position is re-decoded every step, blocks end on
convergence, no mask is ever returned as text, the trace holds every re-decode. Caches: on block-causal models
every cache dmax pairs with decodes as no cache does."""
import json

import pytest
import torch

from conftest import FIXTURES
from dlm_engine.app.sinks import RecordingSink
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.capabilities import Cap, incompatibility, model_incompatibility
from dlm_engine.core.loop import decode
from dlm_engine.core.protocol import CallRequest, SoftInputs, soft_embed
from dlm_engine.core.registry import CACHES, cache_class, load_plugins, strategy_class
from dlm_engine.errors import ConfigError
from dlm_engine.models.loader import load_pretrained

from fakes import ScriptedModel, preferring, random_script

load_plugins()

BD, DREAM = FIXTURES / "bdparity", FIXTURES / "dreamparity"
TINY = FIXTURES.parent.parent / "dlm_engine" / "checkpoints" / "tiny"
FAMILIES = {"llada": TINY, "dream": DREAM / "tiny_dream", "fdv2": BD / "tiny_fdv2", "sdar": BD / "tiny_sdar",
            "llada2": BD / "tiny_llada2", "llada21": BD / "tiny_llada21"}
_MODELS = {}


def model(name, dtype=torch.float32):
    if (name, dtype) not in _MODELS:
        _MODELS[name, dtype] = load_pretrained(FAMILIES[name])[0].eval().to(dtype)
    return _MODELS[name, dtype]


def eos_of(m):
    return int(m.config.eos_token_id)


def dmax(gen, **kw):
    cls = strategy_class("dmax")
    return cls(cls.Config(**{"block_length": 8, **kw}), gen)


def first_layer(m):
    inner = m.model
    return inner.layers[0] if hasattr(inner, "layers") else inner.transformer.blocks[0]


def embedding(m):
    return next(mod for mod in m.modules() if isinstance(mod, torch.nn.Embedding))


# -- the mixture ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mix", ["dinfer", "diffulex"])
def test_soft_embed_is_the_specs_worked_example(mix):
    # |E[A]| = 1, |e_m| = 2, orthogonal, p = .8: s = .8 E[A] + .2 e_m, |s| = .894, target .8 + .4 = 1.2
    table = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    out = soft_embed(table, torch.tensor([[0]]), torch.tensor([[0.8]]), mask_id=1, mix=mix)
    assert torch.allclose(out, torch.tensor([[1.0733, 0.5367]]), atol=1e-4)
    assert abs(float(out.norm()) - 1.2) < 1e-4


@pytest.mark.parametrize("mix", ["dinfer", "diffulex"])
def test_soft_embed_has_the_weighted_norm_and_direction(mix):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 32, generator=g) * torch.rand(50, 1, generator=g) * 3
    tok = torch.randint(0, 49, (6, 2), generator=g)
    p = torch.tensor([[1.0, 0.0], [0.9, 0.0], [0.5, 0.3], [0.2, 0.1], [0.0, 0.0], [0.6, 0.6]])
    out = soft_embed(table, tok, p, mask_id=49, mix=mix)
    pc = p.clamp(0, 1)
    r = (1 - pc.sum(-1)).clamp_min(0)
    s = (pc[..., None] * table[tok]).sum(-2) + r[:, None] * table[49]
    target = (pc * table[tok].norm(dim=-1)).sum(-1) + r * table[49].norm()
    assert torch.allclose(out.norm(dim=-1), target, rtol=1e-4)
    assert torch.allclose(torch.nn.functional.cosine_similarity(out, s, dim=-1), torch.ones(6), atol=1e-5)
    assert torch.allclose(out[4], table[49], atol=1e-4)            # p = 0: the mask embedding itself
    bf = soft_embed(table.bfloat16(), tok, p, mask_id=49, mix=mix)
    assert bf.dtype == torch.bfloat16 and torch.allclose(bf.float(), out, rtol=0.05, atol=0.05)


# -- the model seam, on every bundled family ------------------------------------------------------------------------
def _ids(m, L=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, min(900, int(m.config.vocab_size)), (1, L), generator=g)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_hot_soft_inputs_give_the_plain_forward_of_that_token(family):
    m = model(family)
    mask = int(m.mask_token_id)
    assert Cap.SOFT_INPUTS in m.offers and model_incompatibility(dmax(16), m) is None
    ids = _ids(m)
    cols = torch.tensor([9, 10, 12])
    want = torch.tensor([17, 33, 55])                         # the tokens the soft inputs are one-hot on
    fed = ids.clone()
    fed[0, cols] = mask                                         # the canvas holds masks there
    plain = ids.clone()
    plain[0, cols] = want
    where = torch.zeros(1, 16, dtype=torch.bool)
    where[0, cols] = True
    tok = torch.zeros(1, 16, 1, dtype=torch.long)
    tok[0, cols, 0] = want
    one = torch.zeros(1, 16, 1)
    one[0, cols, 0] = 1.0
    with torch.inference_mode():
        ref = m(plain).logits
        got = m(fed, request=CallRequest(soft=SoftInputs(where, tok, one, mask))).logits
        masked = m(fed).logits
        half = m(fed, request=CallRequest(soft=SoftInputs(where, tok, one * 0.5, mask))).logits
    assert torch.allclose(got, ref, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(masked, ref, atol=1e-2)           # (the soft inputs made the difference)
    assert not torch.allclose(half, ref, atol=1e-3) and not torch.allclose(half, masked, atol=1e-3)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_mask_mixture_reaches_the_first_layer_norm_rescaled(family):
    m = model(family)
    mask = int(m.mask_token_id)
    ids = _ids(m, seed=1)
    seen = []
    hook = first_layer(m).register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    where = torch.zeros(1, 16, dtype=torch.bool)
    where[0, 11] = True
    tok = torch.full((1, 16, 1), 40)
    p = torch.full((1, 16, 1), 0.7)
    try:
        with torch.inference_mode():
            m(ids, request=CallRequest(soft=SoftInputs(where, tok, p, mask)))
    finally:
        hook.remove()
    x = seen[0][0]
    E = embedding(m).weight.detach()
    target = 0.7 * E[40].norm() + 0.3 * E[mask].norm()
    assert abs(float(x[11].norm()) - float(target)) < 1e-4 * float(target)
    mix = 0.7 * E[40] + 0.3 * E[mask]
    assert torch.allclose(x[11], mix * target / mix.norm(), atol=1e-5)
    other = torch.arange(16) != 11
    assert torch.equal(x[other], E[ids[0, other]])              # every other column: its token's embedding


class _NoSeam(ScriptedModel):
    """A third-party model: speaks the protocol but takes no soft inputs (offers nothing)."""

    offers = frozenset()


def test_a_model_without_the_seam_is_refused_in_one_line():
    m = _NoSeam(random_script(), 1000)
    why = model_incompatibility(dmax(16), m)
    assert why and "\n" not in why and "strategy=dmax" in why and "soft_inputs" in why
    assert model_incompatibility(strategy_class("edit")(strategy_class("edit").Config(block_length=8), 16), m) is None
    canvas = Canvas.from_prompts([[5, 6, 7]], 16, 999, 998, eos_id=998)
    with pytest.raises(ConfigError, match="soft_inputs"):
        decode(m, canvas, dmax(16))


# -- the rule's properties --------------------------------------------------------------------------------------------
class Steps(RecordingSink):
    """Each delta with the canvas' masked positions and tokens before it."""

    def on_start(self, canvas, info):
        self.masked, self.tok, self.before = canvas.step_of < 0, canvas.tokens.clone(), []

    def on_delta(self, delta, canvas):
        super().on_delta(delta, canvas)
        self.before.append((self.masked, self.tok))
        self.masked, self.tok = canvas.step_of < 0, canvas.tokens.clone()


def decode_with(make, m, prompt, gen, cache="none", cache_kw=None, **kw):
    """``prompt`` decoded by ``make(gen, **kw)`` under ``cache``: the final canvas and every step (:class:`Steps`)."""
    mask, eos = int(m.config.mask_token_id), int(m.config.eos_token_id)
    canvas = Canvas.from_prompts([prompt], gen, mask, eos, eos_id=eos)
    rec = Steps()
    c = cache_class(cache)(cache_class(cache).Config(**(cache_kw or {})))
    with torch.inference_mode():
        decode(m, canvas, make(gen, **kw), cache=c, sinks=[rec])
    return canvas, rec


def run(m, prompt, gen, cache="none", cache_kw=None, **kw):
    return decode_with(dmax, m, prompt, gen, cache, cache_kw, **kw)


PROMPTS = json.loads((BD / "llada21.json").read_text())["prompts"]


def check_rule(canvas, rec, threshold=0.5, stop=0.9, block=8, cap=None):
    """The spec's properties, step by step, from the recorded deltas."""
    mask = canvas.mask_id
    cap = cap or block
    steps_in_block, last_of_block = {}, {}
    n_redecoded = n_m2t = 0
    for d, (masked, tok) in zip(rec.deltas, rec.before):
        s, W = d.start, d.commit.shape[1]
        assert s % block == 0 and W <= block                      # one block, aligned to column 0
        mk, commit, conf = masked[0, s:s + W], d.commit[0], d.confidence[0].float()
        toks = d.tokens[0]
        b = int(d.scalars["block"])
        steps_in_block[b] = steps_in_block.get(b, 0) + 1
        forced = steps_in_block[b] == cap
        m2t = commit & mk
        k = int(m2t.sum())
        assert not (toks[commit] == mask).any()                   # a commit never writes the mask token
        if mk.any() and not forced:
            # the masks before the first one below the threshold, left to right; else the leftmost mask alone
            prefix = mk & ((mk & (conf < threshold)).long().cumsum(0) == 0)
            if not prefix.any():
                prefix = mk & (mk.long().cumsum(0) == 1)
            assert torch.equal(m2t, prefix & (toks != mask))      # (an argmax of the mask leaves it masked)
        n_redecoded += int((commit & ~mk).sum())
        n_m2t += k
        last_of_block[b] = (d, mk, conf, toks, tok[0, s:s + W], forced)
    for b, (d, mk, conf, toks, old, forced) in last_of_block.items():
        assert steps_in_block[b] <= cap
        if not forced:                                            # converged: all confident or nothing changed
            active_conf_ok = bool((conf[d.commit[0] | mk] >= stop).all())
            assert active_conf_ok or int(d.scalars["edits"]) == 0 and int(d.scalars["committed"]) == 0
    return n_m2t, n_redecoded


def no_mask_in_text(canvas):
    gen = canvas.tokens[0, canvas.gen_start:]
    eos = (gen == canvas.eos_id).nonzero()
    text = gen[: int(eos[0]) if len(eos) else len(gen)]
    return not (text == canvas.mask_id).any()


@pytest.mark.parametrize("family", ["llada", "llada21", "fdv2", "sdar", "dream"])
def test_dmax_commits_a_confident_prefix_and_redecodes_until_convergence(family):
    m = model(family)
    total_redo = 0
    for prompt in PROMPTS[:3]:
        prompt = [t % 90 + 4 for t in prompt] if family == "llada" else prompt    # (the tiny model's vocab is 100)
        canvas, rec = run(m, prompt, 24, eos_early_stop=False)
        _, redo = check_rule(canvas, rec)
        total_redo += redo
        assert not (canvas.tokens[0, canvas.gen_start:] == canvas.mask_id).any()   # no block stops with masks
        # every re-decode rewrites each position written before it in its block
        for d, (masked, _) in zip(rec.deltas, rec.before):
            s, W = d.start, d.commit.shape[1]
            assert int(d.scalars["redecoded"]) == int((d.commit[0] & ~masked[0, s:s + W]).sum()) + \
                int((d.remask[0] if d.remask is not None else torch.zeros(W, dtype=torch.bool)).sum())
    assert total_redo > 10


def test_dmax_stops_after_the_block_holding_an_eos_and_returns_no_mask():
    m = model("llada21")
    stopped = 0
    for prompt in PROMPTS:
        canvas, rec = run(m, prompt, 48)
        check_rule(canvas, rec)
        assert no_mask_in_text(canvas)
        stopped += int((canvas.tokens[0] == canvas.mask_id).any())
    assert stopped >= 1                                           # some run ended early, masks left after its EOS


def test_a_model_preferring_the_mask_token_never_gets_it_into_the_text():
    V, gen, P = 1000, 8, 3
    top = [5, V - 1, 6, V - 1, 7, 8, V - 1, 9]                   # the mask (V - 1) is the argmax at three columns
    conf = [0.95, 0.97, 0.6, 0.99, 0.95, 0.3, 0.92, 0.95]
    m = ScriptedModel(preferring(top, conf, second=[11] * gen)(P), V, mask_id=V - 1, eos_id=V - 2)
    canvas, rec = run(m, [1, 2, 3], gen, eos_early_stop=False)
    assert m.soft_calls > 0                                       # (the fake takes the soft inputs)
    check_rule(canvas, rec)
    out = canvas.tokens[0, P:]
    assert not (out == V - 1).any()
    assert out.tolist() == [5, 11, 6, 11, 7, 11, 11, 9]            # the mask columns took their best other token


def test_the_specs_worked_example():
    """shared/specs/edit_decoding.md 3.8: B = 6, prompt at columns 0-1, threshold 0.5; per forward the scripted
    (token, p) at columns 2..5. Writes, re-decodes, soft inputs and the stop after forward 4 as the spec's table."""
    V, A, B_, C, D, A2, D2 = 32, 10, 11, 12, 13, 14, 15
    table = {1: [(A, .80), (B_, .40), (C, .95), (D, .60)], 2: [(A2, .85), (B_, .70), (C, .92), (D, .30)],
             3: [(A2, .97), (B_, .91), (C, .96), (D2, .45)], 4: [(A2, .98), (B_, .95), (C, .97), (D2, .93)]}
    fed = []

    class Example(ScriptedModel):
        def __call__(self, *a, **kw):
            fed.append(kw["request"].soft)
            return super().__call__(*a, **kw)

    def script(rows, cols, tokens, vocab):
        fwd = len(m.sizes)
        out = torch.full((len(cols), vocab), -30.0)
        for i, c in enumerate(cols.tolist()):
            if 2 <= c < 6:
                t, p = table[fwd][c - 2]
                out[i] = torch.tensor((1 - p) / (vocab - 1)).log()     # softmax(top) = p exactly
                out[i, t] = torch.tensor(p).log()
        return out

    m = Example(script, V, mask_id=V - 1, eos_id=V - 2)
    canvas = Canvas.from_prompts([[1, 2]], 4, V - 1, V - 2, eos_id=V - 2)
    rec = Steps()
    with torch.inference_mode():
        decode(m, canvas, dmax(4, block_length=6, eos_early_stop=False), sinks=[rec])
    assert canvas.nfe == 4 and canvas.tokens[0, 2:].tolist() == [A2, B_, C, D2]
    commits = [d.commit[0, 2:].tolist() for d in rec.deltas]
    assert commits == [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]   # M2T prefix + re-decodes
    assert [int(d.scalars["edits"]) for d in rec.deltas] == [0, 1, 0, 0]            # A -> A' at forward 2
    assert [int(d.scalars["committed"]) for d in rec.deltas] == [1, 2, 1, 0]
    assert fed[0] is None                                                            # forward 1: token ids
    where = [f.where[0, 2:].tolist() for f in fed[1:]]
    assert where == [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert fed[1].tokens[0, 2, 0] == A and abs(float(fed[1].probs[0, 2, 0]) - .80) < 1e-6
    assert fed[2].tokens[0, 2:5, 0].tolist() == [A2, B_, C]
    assert torch.allclose(fed[2].probs[0, 2:5, 0], torch.tensor([.85, .70, .92]))


def test_soft_inputs_are_fed_for_every_written_position_of_the_block():
    m = model("llada21")
    calls = []
    orig = m.forward

    def spy(*a, **kw):
        req = kw.get("request")
        calls.append(None if req is None or req.soft is None else req.soft)
        return orig(*a, **kw)

    m.forward = spy
    try:
        canvas, rec = run(m, PROMPTS[1], 16, eos_early_stop=False)
    finally:
        del m.forward
    assert len(calls) == len(rec.deltas)
    for i, (soft, d) in enumerate(zip(calls, rec.deltas)):
        first_of_block = any(e.kind == "opened" for e in d.block_events)
        if first_of_block:
            assert soft is None                                   # a block's first forward takes token ids
            continue
        assert soft is not None
        prev, (masked, tok) = rec.deltas[i - 1], rec.before[i]
        s, W = d.start, d.commit.shape[1]
        want = ~masked[0, s:s + W] & (canvas.step_of[0, s:s + W] >= 0)   # written (active) positions of the block
        assert torch.equal(soft.where[0, s:s + W], want) and not soft.where[0, :s].any()
        assert torch.equal(soft.tokens[0, s:s + W, 0][want], tok[0, s:s + W][want])
        assert torch.allclose(soft.probs[0, s:s + W, 0][want], prev.confidence[0].float()[want])


def test_the_trace_shows_every_redecode(tmp_path, capsys):
    from dlm_engine.app.api import load_directory, run_prompts
    from dlm_engine.trace import TraceRecorder, open_trace
    from dlm_engine.trace.cli import main as trace_main
    from dlm_engine.trace.tools import edit_events

    lm = load_directory(str(BD / "tiny_llada21"))
    S, C = strategy_class("dmax"), cache_class("none")
    header = {"model": {"name": "tiny_llada21", "eos_id": lm.eos_id, "mask_id": lm.mask_id}, "config": {}}
    path = tmp_path / "dmax.dlmt"
    with TraceRecorder(str(path), header, capture="confidence") as rec:
        stats = run_prompts(lm, PROMPTS[1:3], lambda: S(S.Config(block_length=8, eos_early_stop=False), 24),
                            lambda: C(C.Config()), 24, 1, sinks_for_batch=lambda b, rows: [rec.sink(b, rows)],
                            warmup=False)
    tr = open_trace(path)
    m = model("llada21")
    for seq, row, prompt in zip(tr, stats.rows, PROMPTS[1:3]):
        _, steps = run(m, prompt, 24, eos_early_stop=False)        # the same decode, its deltas kept
        redo = sum(int(d.scalars["redecoded"]) for d in steps.deltas)
        ev = edit_events(seq)
        assert len(ev) == len(seq.edits["col"]) > 0
        for x in ev:                                              # old -> new as the canvas was and became
            assert seq.state_at(x["step"] - 1)[x["position"]] == x["old"]
        assert sum(x["kind"] == "edit" and x["new"] != x["old"] for x in ev) + \
            sum(x["kind"] == "remask" for x in ev) == row.edits
        assert len(ev) == redo                                    # one record per re-decode (and re-mask)
    capsys.readouterr()
    assert trace_main(["show", str(path)]) == 0
    assert "edits" in capsys.readouterr().out


# -- caches ---------------------------------------------------------------------------------------------------------
def _caches():
    return sorted(c for c, ccls in CACHES.items() if incompatibility(dmax(32), ccls()) is None)


def test_dmax_pairs_with_the_store_caches_and_refuses_the_others_in_one_line():
    assert {"none", "block_store", "prefix", "dual", "dllm"} <= set(_caches())
    for c, what in (("d2cache", "block_logits"), ("block_kv", "store_forwards")):
        why = incompatibility(dmax(32), cache_class(c)())
        assert why and "\n" not in why and f"cache={c}" in why and "strategy=dmax" in why and what in why


EXACT = {"prefix": {"refresh_interval": 1}, "dual": {"refresh_interval": 1}, "dllm": {"kp": 1, "kr": 1}}


def _same(got, ref):
    assert torch.equal(got.tokens, ref.tokens)
    assert torch.equal(got.step_of, ref.step_of)
    assert torch.equal(got.row_nfe, ref.row_nfe)


@pytest.mark.parametrize("family", ["llada21", "fdv2", "sdar"])
@pytest.mark.parametrize("cache", _caches())
def test_dmax_on_a_block_causal_model_under_every_cache_equals_no_cache(family, cache):
    """In float64: a cache computes the same function by another path, and the float32 rounding differences of
    the two paths (~1e-6 in a confidence) are fed back through the soft inputs and grow about threefold per step
    on the tiny random-like models, until a token flips after ~15 steps; in float64 they stay far below any flip."""
    m = model(family, torch.float64)
    # dLLM-Cache recomputes the working block's features only every kr steps (and a fraction rou in between): its
    # defaults approximate by design; with kp = kr = 1 it recomputes everything every step
    kw = EXACT.get(cache) if cache == "dllm" else None
    for prompt in PROMPTS[2:4]:
        ref, rec = run(m, prompt, 24, eos_early_stop=False)
        assert sum(int(d.scalars["edits"]) for d in rec.deltas) > 0
        got, _ = run(m, prompt, 24, cache=cache, cache_kw=kw, eos_early_stop=False)
        _same(got, ref)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_dmax_on_a_bidirectional_model(family):
    """Every pairing cache runs without a mask in the text; refreshed at every step, the span caches and dLLM-Cache
    decode as no cache does (their defaults are the usual approximations of a bidirectional model)."""
    m = model(family, torch.float64)         # (float64: see the block-causal test)
    prompt = [5, 9, 13, 21, 7] if family == "llada" else PROMPTS[2][:9]
    ref, rec = run(m, prompt, 24, eos_early_stop=False)
    check_rule(ref, rec)
    for cache in _caches():
        got, r = run(m, prompt, 24, cache=cache, eos_early_stop=False)
        check_rule(got, r)
        assert not (got.tokens[0, got.gen_start:] == got.mask_id).any()
        if cache in EXACT:
            exact, _ = run(m, prompt, 24, cache=cache, cache_kw=EXACT[cache], eos_early_stop=False)
            _same(exact, ref)


@pytest.mark.parametrize("kw", [dict(soft_top_k=2), dict(mix="diffulex"), dict(rm_mask=True, threshold=0.65),
                                dict(max_block_steps=3)])
def test_dmax_options_keep_the_rule(kw):
    m = model("llada21")
    canvas, rec = run(m, PROMPTS[2], 24, eos_early_stop=False, **kw)
    check_rule(canvas, rec, threshold=kw.get("threshold", 0.5), cap=kw.get("max_block_steps"))
    assert not (canvas.tokens[0, canvas.gen_start:] == canvas.mask_id).any()
    base, _ = run(m, PROMPTS[2], 24, eos_early_stop=False)
    if "soft_top_k" in kw:                                        # another soft input, another trajectory
        assert not torch.equal(canvas.tokens, base.tokens) or not torch.equal(canvas.step_of, base.step_of)
    # (mix=diffulex differs from dinfer's blend by rounding only in a float32 model: it matters in bfloat16)


def test_bad_dmax_settings_are_one_line_errors():
    for kw, what in ((dict(mix="avg"), "strategy.mix='avg'"), (dict(temperature=0.7), "strategy.temperature=0.7"),
                     (dict(soft_top_k=0), "strategy.soft_top_k=0"), (dict(stop_confidence=0), "stop_confidence"),
                     (dict(threshold=1.5), "strategy.threshold=1.5"), (dict(max_block_steps=0), "max_block_steps=0")):
        with pytest.raises(ConfigError, match=what.replace(".", r"\.").replace("'", ".")) as e:
            dmax(16, **kw)
        assert "\n" not in str(e.value)


def test_redecoded_tokens_converge_on_the_embedded_model():
    """On the embedded model a block whose re-decodes change tokens goes on until a step changes nothing (or all
    is confident), well before the cap: the re-decoded tokens settle."""
    from dlm_engine.app.api import load_directory

    tok = load_directory(str(TINY)).tokenizer
    m = model("llada")
    settled = 0
    for text in ["347+085=", "123+456=", "name a fruit:", "590-403=", "name a colour:"]:
        canvas, rec = run(m, tok.encode(text), 16, eos_early_stop=False)
        check_rule(canvas, rec)
        blocks = {}
        for d in rec.deltas:
            blocks.setdefault(int(d.scalars["block"]), []).append(d)
        for steps in blocks.values():
            edits = [int(d.scalars["edits"]) for d in steps]
            last = steps[-1]
            if any(edits) and len(steps) < 8:
                assert edits[-1] == 0 and int(last.scalars["committed"]) == 0 or \
                    bool((last.confidence[0] >= 0.9).all())
                settled += 1
    assert settled >= 1
