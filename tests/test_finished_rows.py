"""Finished rows stop costing work (dlm_engine/core/rows.py): once a row of a batch is finished (stop at EOS,
early exit) the model runs on the active rows only, KV caches drop the finished rows' keys/values, and every
row still decodes exactly as it does alone at T = 0, with unchanged NFE and per-row NFE. Also: the EOS
options (logits_eos_inf, confidence_eos_eot_inf, stop_at_eos) of threshold, factor and block_buffer."""
import dataclasses

import pytest
import torch

from dlm_engine.core import sampler
from dlm_engine.core.canvas import Canvas
from dlm_engine.errors import ConfigError
from dlm_engine.core.loop import decode
from dlm_engine.core.protocol import ForwardCall
from dlm_engine.core.registry import cache_class, strategy_class

PROMPTS = [[735, 559, 771, 678, 375, 377], [127, 157, 983, 804, 991, 537, 902, 490, 136, 103, 962], [413, 750, 0]]
GEN = 16


class Recorder:
    """Wraps a model; records the batch size and ``CallRequest.rows`` of every call."""

    def __init__(self, model):
        self.model, self.sizes, self.rows = model, [], []

    def __call__(self, ids, **kw):
        self.sizes.append(int(ids.shape[0]))
        rows = kw["request"].rows
        self.rows.append(None if rows is None else rows.tolist())
        return self.model(ids, **kw)


def make_cache(name):
    cls = cache_class(name)
    return cls(cls.Config())


def run(model, name, prompts, cache="none", eos=None, compact=True, seed=None, **kw):
    cls = strategy_class(name)
    canvas = Canvas.from_prompts(prompts, GEN, 1000, 1001, eos_id=eos)
    rec = Recorder(model)
    if seed is not None:
        torch.manual_seed(seed)
    decode(rec, canvas, cls(cls.Config(**kw), GEN), cache=make_cache(cache), compact=compact)
    return canvas, rec


def pick_eos(model, name, cache, row, **kw):
    """A token that the plain decode of the batch commits in the first block of ``row`` and nowhere in the
    other rows' generations: used as the EOS id, it ends ``row`` early and no other row."""
    canvas, _ = run(model, name, PROMPTS, cache, **kw)
    g = canvas.gen_start
    others = set(canvas.tokens[[r for r in range(len(PROMPTS)) if r != row], g:].flatten().tolist())
    first = [t for t in canvas.tokens[row, g:g + 4].tolist() if t not in others]
    assert first, "no usable EOS token for this case"
    return first[0]


CASES = [
    ("low_confidence", "none", dict(steps=16, block_length=4)),
    ("low_confidence", "prefix", dict(steps=16, block_length=4)),
    ("low_confidence", "dual", dict(steps=16, block_length=4)),
    ("low_confidence", "prefix", dict(steps=16, block_length=4, cfg_scale=1.0)),
    ("low_confidence", "dual", dict(steps=8, block_length=4, loop="fastdllm")),
    ("threshold", "none", dict(block_length=4, threshold=0.5)),
    ("threshold", "prefix", dict(block_length=4, threshold=0.5)),
    ("threshold", "dual", dict(block_length=4, threshold=0.5)),
    ("factor", "dual", dict(block_length=4, factor=2.0)),
    ("block_buffer", "none", dict(block_length=4, buffer_size=2, accept_threshold=0.5)),
    ("block_buffer", "dual", dict(block_length=4, buffer_size=2, accept_threshold=0.5)),
    ("block_buffer", "block_store", dict(block_length=4, buffer_size=2, accept_threshold=0.5)),
]


@pytest.mark.parametrize("name,cache,kw", CASES, ids=[f"{n}-{c}-{i}" for i, (n, c, _) in enumerate(CASES)])
def test_stop_at_eos_row_stops_costing_work(tiny_llada, name, cache, kw):
    row = 1                                       # the middle row: the active rows [0, 2] are not a prefix
    eos = pick_eos(tiny_llada, name, cache, row, **kw)
    canvas, rec = run(tiny_llada, name, PROMPTS, cache, eos=eos, stop_at_eos=True, **kw)
    full = 2 * len(PROMPTS) if kw.get("cfg_scale") else len(PROMPTS)
    B = len(PROMPTS)
    # (a) the row finished early and the model ran on fewer rows from then on, never more again
    sits_out = name in ("threshold", "factor") or kw.get("loop") == "fastdllm"   # rows with a full block wait
    assert bool(canvas.finished[row]) and rec.sizes[0] == full and rec.rows[0] is None
    if not sits_out:                              # (rows that sit a step out come back for the next block)
        assert all(a >= b for a, b in zip(rec.sizes, rec.sizes[1:]))
    assert any(r is not None and row not in r and r for r in rec.rows)      # others ran without it
    if name == "low_confidence":                  # fixed schedule: only the EOS row ends early
        assert rec.rows[-1] == [0, 2] + ([3, 5] if kw.get("cfg_scale") else [])
    # (b) every row equals that row decoded alone (not for block_buffer with an approximate cache: its
    # batch-wide window and store points move the cache's refresh/store steps with the batch, so there a
    # batched row differs from its decode alone with or without compaction)
    g = canvas.gen_start
    for r, p in enumerate(PROMPTS if name != "block_buffer" or cache == "none" else []):
        alone, _ = run(tiny_llada, name, [p], cache, eos=eos, stop_at_eos=True, **kw)
        assert torch.equal(canvas.tokens[r, g:], alone.tokens[0, alone.gen_start:]), f"row {r}"
        if name == "low_confidence":              # fixed global schedule: same commit steps as alone
            assert torch.equal(canvas.step_of[r, g:], alone.step_of[0, alone.gen_start:]), f"row {r}"
    # (c) the same run without compaction: same tokens, steps, NFE and per-row NFE, but more rows computed
    plain, prec = run(tiny_llada, name, PROMPTS, cache, eos=eos, stop_at_eos=True, compact=False, **kw)
    assert torch.equal(canvas.tokens, plain.tokens) and torch.equal(canvas.step_of, plain.step_of)
    assert canvas.nfe == plain.nfe and torch.equal(canvas.row_nfe, plain.row_nfe)
    assert canvas.row_nfe[row] < canvas.row_nfe.max()
    # block fillers let a row whose block is full sit steps out (the finished row has no mask left), so only
    # the others keep every row in every call without compaction
    if not sits_out:
        assert sum(rec.sizes) < sum(prec.sizes) and set(prec.sizes) == {full}
    assert sum(rec.sizes) == int(canvas.row_nfe.sum()) * full // B    # work done = per-row NFE


def test_early_exit_per_row_exit(tiny_llada):
    """early_exit: the row with the largest first-step answer gap exits at step 1; the rest keep decoding
    on a smaller batch and equal their decode alone."""
    from dlm_engine.app.sinks import RecordingSink

    base = dict(steps=16, block_length=8, answer_start=0, answer_length=4)
    never = dict(early_threshold=1e9, mid_threshold=1e9, late_threshold=1e9)
    cls = strategy_class("early_exit")
    canvas = Canvas.from_prompts(PROMPTS, GEN, 1000, 1001)
    sink = RecordingSink()
    decode(tiny_llada, canvas, cls(cls.Config(**base, **never), GEN), sinks=[sink])
    gap1 = sink.deltas[0].scalars["gap"]
    row = int(gap1.argmax())
    assert int((gap1 >= gap1[row]).sum()) == 1
    thr = float(gap1[row])
    kw = dict(base, early_threshold=thr, mid_threshold=thr, late_threshold=thr)
    out, rec = run(tiny_llada, "early_exit", PROMPTS, **kw)
    assert bool(out.finished[row]) and rec.sizes[0] == 3 and rec.sizes[1] < 3
    assert row not in (rec.rows[1] or [])
    plain, prec = run(tiny_llada, "early_exit", PROMPTS, compact=False, **kw)
    assert torch.equal(out.tokens, plain.tokens) and torch.equal(out.step_of, plain.step_of)
    assert out.nfe == plain.nfe and torch.equal(out.row_nfe, plain.row_nfe) and out.row_nfe[row] == 1
    assert sum(rec.sizes) < sum(prec.sizes)
    for r, p in enumerate(PROMPTS):
        alone, _ = run(tiny_llada, "early_exit", [p], **kw)
        assert torch.equal(out.tokens[r, out.gen_start:], alone.tokens[0, alone.gen_start:]), f"row {r}"


def test_no_finished_row_no_row_indices(tiny_llada):
    """While every row is active the model gets the full batch and no ``rows`` extra (zero-cost path)."""
    canvas, rec = run(tiny_llada, "low_confidence", PROMPTS, "dual", steps=16, block_length=4)
    assert set(rec.sizes) == {3} and set(map(str, rec.rows)) == {"None"} and len(rec.sizes) == canvas.nfe


def test_steps_after_every_row_finished_still_count_as_real_calls(tiny_llada):
    """LLaDA's zero-transfer steps after the last commit run (as in the reference) and NFE equals model calls."""
    # 2 blocks of 8 tokens, 16 steps each: 8 committing + 8 zero-transfer steps per block; every row is
    # finished after step 24, so steps 25..32 commit nothing but still cost a forward
    canvas, rec = run(tiny_llada, "low_confidence", PROMPTS, steps=32, block_length=8)
    plain, prec = run(tiny_llada, "low_confidence", PROMPTS, compact=False, steps=32, block_length=8)
    assert canvas.nfe == plain.nfe == 32 and len(prec.sizes) == 32
    assert len(rec.sizes) == canvas.nfe  # NFE is the number of model calls, never a schedule count
    assert torch.equal(canvas.row_nfe, plain.row_nfe) and canvas.row_nfe.tolist() == [24] * 3
    assert torch.equal(canvas.tokens, plain.tokens) and torch.equal(canvas.step_of, plain.step_of)


def test_row_nfe_counts_steps_of_every_row_on_the_host_and_the_others_per_row():
    """``Canvas.apply`` counts a step whose ``active`` is the canvas' own ``every_row()`` tensor on the host (no
    kernel) and any other ``active`` per row on the device; ``row_nfe`` is their sum."""
    from dlm_engine.core.canvas import FrameDelta

    canvas = Canvas.from_prompts([[5, 6], [7]], 4, 3, 0)
    B, W, g = 2, 4, canvas.gen_start

    def step(active, nfe=1, commit_col=None):
        commit = torch.zeros(B, W, dtype=torch.bool)
        if commit_col is not None:
            commit[:, commit_col] = True
        canvas.apply(FrameDelta(step=canvas.step + 1, nfe=nfe, start=g, commit=commit, tokens=torch.full((B, W), 9),
                                active=active, finished=torch.zeros(B, dtype=torch.bool)))

    assert canvas.row_nfe.tolist() == [0, 0]
    step(canvas.every_row(), commit_col=0)
    step(canvas.every_row(), nfe=2)                     # e.g. a two-forward step
    assert canvas.row_nfe.tolist() == [3, 3] and canvas._row_nfe.tolist() == [0, 0]   # host count only
    step(torch.tensor([True, False]), commit_col=1)
    step(torch.ones(B, dtype=torch.bool))               # all True, but not the canvas' tensor: per row
    step(canvas.every_row(), nfe=0)                     # a set-up step costs nothing
    assert canvas.row_nfe.tolist() == [5, 4] and canvas.nfe == 5
    assert canvas.every_row() is canvas.every_row() and canvas.every_row().all()
    assert canvas.tokens[:, g:g + 2].tolist() == [[9, 9], [9, 9]]


def test_sampler_draws_use_the_active_batch(tiny_llada, monkeypatch):
    """At T > 0 the Gumbel draws have the active batch's shape (documented: batched T > 0 runs with rows
    that finish early differ from runs without compaction)."""
    shapes = []
    real = sampler.noise_draw

    def spy(shape, device):
        shapes.append(tuple(shape)[0])
        return real(shape, device)

    monkeypatch.setattr(sampler, "noise_draw", spy)
    kw = dict(steps=16, block_length=4, temperature=0.5)
    torch.manual_seed(0)
    probe, _ = run(tiny_llada, "low_confidence", PROMPTS, **kw)
    g = probe.gen_start
    others = set(probe.tokens[[0, 2], g:].flatten().tolist())
    eos = next(t for t in probe.tokens[1, g:g + 4].tolist() if t not in others)
    shapes.clear()
    canvas, rec = run(tiny_llada, "low_confidence", PROMPTS, eos=eos, stop_at_eos=True, seed=0, **kw)
    assert bool(canvas.finished[1]) and shapes == rec.sizes and min(shapes) == 2


def test_stored_cache_keeps_the_right_rows():
    """StoredKVCache + RowStore: dropping rows keeps the others' keys/values (rows of the full batch)."""
    from dlm_engine.core.protocol import AttentionIO, CacheDirective, CallRequest, Columns

    cache = make_cache("dual")
    cache.begin(None)
    d = CacheDirective(block=(2, 4), block_start=True)
    L = 6

    def call(rows, fill, start):
        B = 4 if rows is None else len(rows)
        ids = torch.zeros((B, L), dtype=torch.long)
        req = CallRequest(directive=dataclasses.replace(d, block_start=start))
        if rows is not None:                       # the other rows finished: they are not live any more
            req.rows, req.live, req.full_batch = torch.tensor(rows), torch.tensor(rows), 4
        c = ForwardCall(input_ids=ids, position_ids=ids, key_mask=None, columns=Columns.span(0, L),
                        logits_range=(0, L), request=req)
        with cache.forward(c) as c:
            a, b = c.compute
            k = fill[:, None, a:b, None].float().expand(B, 1, b - a, 2).clone()
            io = AttentionIO(layer=0, x=k, call=c)
            with cache.attention(0, io) as io:
                kk, vv, cols = cache.keys_values(0, io, k, k.clone())
                return c, kk[:, 0, :, 0]

    base = torch.arange(4)[:, None] * 10 + torch.arange(L)[None, :]        # row r, column j -> 10 r + j
    c, k = call(None, base, True)
    assert c.compute == (0, L) and torch.equal(k, base.float())
    c, k = call([0, 2, 3], base[[0, 2, 3]] + 100, False)                   # row 1 finished; block recomputed
    assert c.compute == (2, 4) and not c.refreshed
    want = base[[0, 2, 3]].float()
    want[:, 2:4] += 100
    assert torch.equal(k, want)
    c, k = call([3], base[[3]] + 200, False)                               # rows 0 and 2 finished too
    want = want[[2]]
    want[:, 2:4] = base[3, 2:4] + 200
    assert torch.equal(k, want) and cache.k[0].shape[0] == 1


# -- EOS options of threshold / factor / block_buffer (a scripted model whose preferences are known) -----

from fakes import EOS, EOT, MASK, P, Scripted  # noqa: E402


ROW_EOS = ([1, 2, EOS, EOS, EOS, EOS], [0.9, 0.8, 0.99, 0.5, 0.5, 0.5], [3, 4, 5, EOT, 6, 6])
ROW_LONG = ([1, 2, 3, 4, 5, EOS], [0.7, 0.68, 0.66, 0.64, 0.62, 0.55], [3, 4, 5, 6, 6, 6])
FILL = {"threshold": dict(threshold=0.95), "factor": dict(factor=0.5),
        "block_buffer": dict(block_length=6, accept_threshold=0.95)}


def run_scripted(name, rows=(ROW_EOS,), eos=EOS, eot=EOT, **kw):
    m = Scripted(*zip(*rows))
    cls = strategy_class(name)
    canvas = Canvas.from_prompts([[0, 1]] * len(rows), 6, MASK, 0, eos_id=eos, eot_id=eot)
    decode(m, canvas, cls(cls.Config(**FILL[name], **kw), 6))
    return canvas, m


@pytest.mark.parametrize("name", sorted(FILL))
def test_eos_options_are_shared(name):
    from dlm_engine.core.eos import EosOptions

    fields = {f.name for f in dataclasses.fields(strategy_class(name).Config)}
    assert {f.name for f in dataclasses.fields(EosOptions)} <= fields


@pytest.mark.parametrize("name", sorted(FILL))
def test_logits_eos_inf(name):
    plain, _ = run_scripted(name)
    assert EOS in plain.tokens[0, P:].tolist()
    c, _ = run_scripted(name, logits_eos_inf=True)
    assert EOS not in c.tokens[0, P:].tolist()
    assert c.tokens[0, P:].tolist() == [1, 2, 5, EOT, 6, 6]


@pytest.mark.parametrize("name", sorted(FILL))
def test_confidence_eos_eot_inf_ranks_eos_last(name):
    plain, _ = run_scripted(name)
    assert plain.step_of[0, P + 2] == 1                  # EOS (0.99) is the most confident proposal
    c, _ = run_scripted(name, confidence_eos_eot_inf=True)
    so = c.step_of[0, P:].tolist()
    assert c.tokens[0, P:].tolist() == [1, 2, EOS, EOS, EOS, EOS]
    assert max(so[0], so[1]) < min(so[2:])               # every EOS proposal is ranked after 1 and 2


@pytest.mark.parametrize("name", sorted(FILL))
def test_stop_at_eos_ends_rows_and_saves_work(name):
    plain, pm = run_scripted(name, rows=(ROW_EOS, ROW_LONG))
    c, m = run_scripted(name, rows=(ROW_EOS, ROW_LONG), stop_at_eos=True)
    assert c.tokens[0, P:].tolist() == [1, 2, EOS, EOS, EOS, EOS] and bool(c.finished.all())
    assert c.tokens[1, P:].tolist() == plain.tokens[1, P:].tolist() == [1, 2, 3, 4, 5, EOS]
    assert c.row_nfe[0] < plain.row_nfe[0] and c.row_nfe[1] == plain.row_nfe[1]
    assert m.sizes[-1] == 1 and sum(m.sizes) == int(c.row_nfe.sum()) < sum(pm.sizes)


@pytest.mark.parametrize("name", sorted(FILL))
def test_eos_options_need_the_models_ids(name):
    for key in ("logits_eos_inf", "stop_at_eos", "confidence_eos_eot_inf"):
        with pytest.raises(ConfigError, match=f"strategy.{key}"):
            run_scripted(name, eos=None, eot=None, **{key: True})


class FinishedCheck:
    """A sink checking ``FrameDelta.finished`` against the canvas: it flags exactly the rows that finish at this
    step, never a row finished before (rows sit steps out once finished), and every row left without a masked
    generated position."""

    wants_logits = wants_recomputed = False

    def on_start(self, canvas, info):
        self.prev, self.exercised, self.bad = canvas.finished.clone(), 0, []

    def on_delta(self, delta, canvas):
        prev, g = self.prev, canvas.gen_start
        left = (canvas.step_of[:, g:] < 0).any(-1)                  # the canvas once the delta is applied
        if (delta.finished & prev).any():
            self.bad.append(f"step {delta.step}: rows finished before are flagged again")
        if (~left & ~prev & ~delta.finished).any():
            self.bad.append(f"step {delta.step}: a row without masks left is not flagged")
        self.exercised += int(bool(prev.any()) and not bool(prev.all()))
        self.prev = canvas.finished.clone()

    def on_end(self, canvas):
        pass


FINISH_CASES = CASES + [
    ("early_exit", "none", dict(answer_start=0, steps=16, block_length=4)),
    ("d2c", "none", dict(threshold=0.5, block_length=4)),
    ("d2c", "dual", dict(threshold=0.5, block_length=4)),
    ("klass", "none", dict(threshold=0.5, block_length=4)),
    ("ar", "none", dict(threshold=0.5, block_length=4)),
    ("wino", "none", dict(block_length=4)),
]


@pytest.mark.parametrize("name,cache,kw", FINISH_CASES,
                         ids=[f"{n}-{c}-{i}" for i, (n, c, _) in enumerate(FINISH_CASES)])
def test_delta_finished_flags_exactly_the_rows_that_finish(tiny_llada, name, cache, kw):
    """A delta's finished rows agree with the canvas on a batch whose rows finish at different steps (EOS stops
    included)."""
    cls = strategy_class(name)
    if "stop_at_eos" in cls.Config.__dataclass_fields__:
        kw = dict(kw, stop_at_eos=True)
        eos = pick_eos(tiny_llada, name, cache, 0, **{k: v for k, v in kw.items() if k != "stop_at_eos"})
    else:
        eos = None
    canvas = Canvas.from_prompts(PROMPTS, GEN, 1000, 1001, eos_id=eos)
    check = FinishedCheck()
    decode(tiny_llada, canvas, cls(cls.Config(**kw), GEN), cache=make_cache(cache), sinks=[check])
    assert not check.bad, check.bad[:3]
    assert bool(canvas.finished.all())
    if eos is not None or name == "d2c":
        assert check.exercised, "no step ran with some rows finished and others not"
