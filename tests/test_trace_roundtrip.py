"""Trace round trips: every registered strategy, batches, capture levels, remask/edit events."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from dlm_engine.core.canvas import BlockEvent, Canvas, FrameDelta  # noqa: E402
from dlm_engine.errors import ConfigError  # noqa: E402
from dlm_engine.app.api import load_model, run_prompts  # noqa: E402
from dlm_engine.core.loop import Sink  # noqa: E402
from dlm_engine.core.registry import STRATEGIES, cache_class, load_plugins  # noqa: E402
from dlm_engine.trace import TraceRecorder, open_trace  # noqa: E402
from dlm_engine.trace import format as fmt  # noqa: E402

load_plugins()
STRATEGY_NAMES = sorted(STRATEGIES)   # discovered: strategies added later are covered automatically
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def lm():
    from dlm_engine.app.config import model_preset

    mc = model_preset("tiny_random")
    return load_model(mc, "cpu", "float32")


HEADER = {"model": {"eos_id": 2, "mask_id": 3}, "tokenizer": {"kind": "char"}}


class StateSink(Sink):
    """The canvas after every step, the deltas, and the final canvas of one batch."""

    def __init__(self):
        self.states, self.deltas, self.final = [], [], None

    def on_delta(self, delta, canvas):
        self.deltas.append(delta)
        self.states.append((canvas.tokens.clone(), canvas.step_of.clone()))

    def on_end(self, canvas):
        self.final = canvas


def make_strategy(name, gen_length=16):
    """The strategy from its Config defaults; a few small settings if the defaults do not fit gen_length."""
    cls = STRATEGIES[name]
    names = {f.name for f in dataclasses.fields(cls.Config)}
    tries = [{}]
    for key in ("block_length", "initial_block_length"):
        if key in names:
            tries += [{key: 8}, {key: gen_length}]
    tries.append({k: v for k, v in {"block_length": 8, "steps": gen_length}.items() if k in names})
    last = None
    for kw in tries:
        try:
            conf = cls.Config(**kw)
            return lambda: cls(conf, gen_length)
        except (ConfigError, TypeError) as exc:
            last = exc
            continue
    raise AssertionError(f"cannot build strategy {name} for gen_length={gen_length}: {last}")


def record_run(lm, path, name, prompts, batch_size=2, capture="tokens", gen_length=16, make=None, **rec_kw):
    make = make or make_strategy(name, gen_length)
    state_sinks = {}

    def sinks(b, rows):
        state_sinks[b] = (rows, StateSink())
        return [rec.sink(b, rows), state_sinks[b][1]]

    torch.manual_seed(0)
    with TraceRecorder(str(path), HEADER, capture=capture, **rec_kw) as rec:
        stats = run_prompts(lm, [lm.encode(p) for p in prompts], make, lambda: cache_class("none")(cache_class("none").Config()),
                            gen_length, batch_size, sinks_for_batch=sinks, prompts=prompts, warmup=False)
    return stats, state_sinks, rec


PROMPTS = ["347+085=", "hi", "name a fruit:"]


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_round_trip_every_strategy(lm, tmp_path, name):
    path = tmp_path / "t.dlmt"
    stats, state_sinks, rec = record_run(lm, path, name, PROMPTS, batch_size=2)
    assert os.path.exists(path) and not os.path.exists(str(path) + ".partial")
    tr = open_trace(path, recover=False)
    assert tr.ok and len(tr) == len(PROMPTS)
    assert [s.row for s in tr] == list(range(len(PROMPTS)))
    for s, row in zip(tr, stats.rows):
        # replayed outputs == decoded outputs
        assert s.tokens.tolist() == row.tokens
        assert s.step_of.tolist() == row.step_of
        assert s.text == row.text
        assert s.nfe == row.nfe
        assert s.prompt_ids.tolist() == row.prompt_ids
    for b, (rows, sink) in state_sinks.items():
        canvas = sink.final
        g = canvas.gen_start
        assert len(tr.batches[b].steps) == len(sink.deltas)
        assert tr.batches[b].steps.nfe.tolist() == [d.nfe for d in sink.deltas]
        for i, r in enumerate(rows):
            s = tr[r]
            # state_at(t) equals the canvas the loop saw after step t
            for (tokens, step_of), d in zip(sink.states, sink.deltas):
                assert np.array_equal(s.canvas_at(d.step), tokens[i].numpy()), (name, r, d.step)
                assert np.array_equal(s.state_at(d.step), tokens[i, g:].numpy())
            assert np.array_equal(s.state_at(0), np.where(canvas.step_of[i, g:].numpy() == 0,
                                                          canvas.tokens[i, g:].numpy(), canvas.mask_id))
            assert s.steps.active.shape == (len(sink.deltas),)


def test_capture_levels(lm, tmp_path):
    bound = 0.02
    for capture in ("confidence", "topk", "logits"):
        path = tmp_path / f"{capture}.dlmt"
        stats, state_sinks, rec = record_run(lm, path, "low_confidence", PROMPTS, batch_size=3, capture=capture,
                                             topk=4, logit_error_bound=bound)
        tr = open_trace(path, recover=False)
        rows, sink = state_sinks[0]
        g = sink.final.gen_start
        for i, s in enumerate(tr):
            # the confidence of each committed position at its commit step (float16 precision)
            exp = np.full(s.gen_length, np.nan, dtype=np.float32)
            for d in sink.deltas:
                c = d.commit[i].numpy()
                cols = np.flatnonzero(c) + d.start - g
                exp[cols] = d.confidence[i].numpy()[c]
            np.testing.assert_allclose(s.confidence, exp.astype(np.float16).astype(np.float32), rtol=0, atol=0)
            if capture == "confidence":
                assert s.topk is None
                continue
            cols, ids, lg = s.topk
            assert ids.shape == (int((s.step_of >= 1).sum()), 4)
            for j, col in enumerate(cols):
                d = sink.deltas[s.step_of[col - g] - 1]
                full = d.logits[i, col - d.start].float()
                v, k = torch.topk(full, 4)
                assert ids[j].tolist() == k.tolist()
                np.testing.assert_array_equal(lg[j], v.numpy())
                assert ids[j, 0] == s.tokens[col - g]   # temperature 0: the committed token is the argmax
        if capture == "logits":
            assert len(tr.logit_steps()) == len(sink.deltas)
            for d in sink.deltas:
                start, lg = tr.logits(0, d.step)
                assert start == d.start
                err = np.abs(lg.astype(np.float64) - d.logits.numpy().astype(np.float64))
                assert err.max() <= bound
        else:
            assert tr.logit_steps() == []


def test_quantized_logits_bound_and_specials():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5, 257)) * 12).astype(np.float32)
    x[0, 0, :4] = [-np.inf, np.inf, np.nan, 3e38]
    x[1, 2, 7] = -1e30
    x[2, 4, :] = -np.inf
    for bound in (1e-2, 1e-3, 0.5):
        meta, arrays = fmt.quantize_logits(x, bound)
        payload = fmt.encode_bundle(meta, arrays)
        y = fmt.dequantize_logits(*fmt.decode_bundle(payload))
        fin = np.isfinite(x)
        assert np.all(np.abs(y[fin].astype(np.float64) - x[fin].astype(np.float64)) <= bound)
        assert np.array_equal(x[~fin].view(np.uint32), y[~fin].view(np.uint32))  # -inf/+inf/NaN bit-exact
    # a record claiming an error above its bound is rejected on decode
    meta["max_error"] = meta["bound"] * 2
    with pytest.raises(fmt.TraceError):
        fmt.dequantize_logits(meta, arrays)


def test_rows_of_several_batches_in_results_order(lm, tmp_path):
    prompts = ["a", "bb", "ccc", "dddd", "eeeee"]
    stats, state_sinks, _ = record_run(lm, tmp_path / "b.dlmt", "low_confidence", prompts, batch_size=2)
    tr = open_trace(tmp_path / "b.dlmt", recover=False)
    assert len(tr.batches) == 3 and [s.row for s in tr] == [0, 1, 2, 3, 4]
    assert [s.text for s in tr] == [r.text for r in stats.rows]
    assert [tr.batches[b].rows for b in sorted(tr.batches)] == [[0, 1], [2, 3], [4]]


def _apply_and_emit(canvas, sinks, delta):
    canvas.apply(delta)
    for s in sinks:
        s.on_delta(delta, canvas)


def test_remask_and_edit_events_round_trip(tmp_path):
    """Crafted deltas: commits, remasks (with and without recommit), overwrites of committed tokens."""
    mask = 3
    canvas = Canvas.from_prompts([[10, 11], [12]], gen_length=6, mask_id=mask, pad_id=0)
    canvas.tokens[:, canvas.gen_start + 5] = 42              # a given token in the region (step 0)
    canvas.step_of[:, canvas.gen_start + 5] = 0
    B, g = 2, canvas.gen_start
    rec = TraceRecorder(str(tmp_path / "r.dlmt"), HEADER, capture="confidence")
    states = StateSink()
    sinks = [rec.sink(0, [0, 1]), states]
    for s in sinks:
        s.on_start(canvas, {"strategy": "crafted"})

    def d(step, start, W, commit, tokens, remask=None, conf=None, finished=(False, False), events=(), scalars=None):
        return FrameDelta(step=step, nfe=1, start=start, commit=torch.tensor(commit), tokens=torch.tensor(tokens),
                          active=torch.ones(B, dtype=torch.bool), finished=torch.tensor(finished),
                          confidence=torch.tensor(conf if conf is not None else [[0.5] * W] * B),
                          remask=None if remask is None else torch.tensor(remask), block_events=list(events),
                          scalars=scalars or {"k": torch.tensor([1, 2]), "x": 0.5 * step})

    T, F = True, False
    _apply_and_emit(canvas, sinks, d(1, g, 3, [[T, F, F], [T, T, F]], [[20, 0, 0], [21, 22, 0]],
                                     conf=[[0.9, 0, 0], [0.8, 0.7, 0]], events=[BlockEvent("opened", 0, g, g + 3)]))
    # step 2: remask row 0 col g (committed at 1) and recommit it at once with another token;
    # row 1: overwrite col g+1 without remasking
    _apply_and_emit(canvas, sinks, d(2, g, 3, [[T, T, F], [F, T, F]], [[30, 31, 0], [0, 32, 0]],
                                     remask=[[T, F, F], [F, F, F]], conf=[[0.6, 0.61, 0], [0, 0.62, 0]]))
    # step 3: remask row 1 col g (no recommit) and the given token of row 0 (col g+5); commit the rest
    _apply_and_emit(canvas, sinks, d(3, g, 6, [[F, F, T, T, T, F], [F, F, T, T, T, T]],
                                     [[0, 0, 40, 41, 43, 0], [0, 0, 44, 45, 46, 47]],
                                     remask=[[F, F, F, F, F, T], [T, F, F, F, F, F]],
                                     scalars={"k": torch.tensor([3, 4]), "x": 1.5, "only_here": 7}))
    _apply_and_emit(canvas, sinks, d(4, g, 6, [[T, F, F, F, F, T], [T, F, F, F, F, F]], [[50, 0, 0, 0, 0, 51], [52, 0, 0, 0, 0, 0]],
                                     finished=(True, True), events=[BlockEvent("completed", 0, g, g + 6, row=1)]))
    for s in sinks:
        s.on_end(canvas)
    rec.close()
    tr = open_trace(tmp_path / "r.dlmt", recover=False)
    for i, s in enumerate(tr):
        assert np.array_equal(s.tokens, canvas.tokens[i, g:].numpy())
        assert np.array_equal(s.step_of, canvas.step_of[i, g:].numpy())
        assert s.edits is not None and len(s.edits["col"]) >= 1
        assert np.array_equal(s.state_at(0), np.where(np.arange(6) == 5, 42, mask) if i == 0 else
                              np.where(np.arange(6) == 5, 42, mask))
        for (tokens, _), delta in zip(states.states, states.deltas):
            assert np.array_equal(s.canvas_at(delta.step), tokens[i].numpy()), (i, delta.step)
        assert s.finish_step == 4
    s0, s1 = tr[0], tr[1]
    # the first holding of row 0 col g: token 20 at steps [1, 2), with its confidence
    e = s0.edits
    k = list(zip(e["col"].tolist(), e["token"].tolist(), e["start"].tolist(), e["end"].tolist()))
    assert (g, 20, 1, 2) in k and (g + 5, 42, 0, 3) in k
    assert np.isclose(e["confidence"][k.index((g, 20, 1, 2))], 0.9, atol=1e-3)
    k1 = list(zip(s1.edits["col"].tolist(), s1.edits["token"].tolist(), s1.edits["start"].tolist(), s1.edits["end"].tolist()))
    assert (g + 1, 22, 1, 2) in k1 and (g, 21, 1, 3) in k1
    st = tr.batches[0].steps
    assert st.scalars["k"].tolist() == [[1, 2], [1, 2], [3, 4], [1, 2]]
    assert st.scalars["x"].tolist() == [0.5, 1.0, 1.5, 2.0]
    assert st.scalars["only_here"][2] == 7 and np.isnan(st.scalars["only_here"][0])
    assert s1.steps.scalars["k"].tolist() == [2, 2, 4, 2]
    assert [(e[0], e[1], e[5]) for e in st.events] == [(1, "opened", -1), (4, "completed", 1)]
    assert [e[1] for e in s0.steps.events] == ["opened"]
    assert s0.commits_per_step().tolist() == [0, 1, 2, 3, 2]


def test_records_are_the_final_canvas_and_a_change_outside_the_deltas_is_flagged(tmp_path):
    """The writer keeps no copy of the canvas: a sequence record is the final canvas plus what the deltas told
    (edits, confidences). A canvas changed outside the deltas is recorded as it ended, and the batch end says
    the deltas do not account for it (``mismatch``); the same stream without the change is not flagged."""
    for tamper in (False, True):
        canvas = Canvas.from_prompts([[10, 11], [12]], gen_length=4, mask_id=3, pad_id=0)
        g = canvas.gen_start
        rec = TraceRecorder(str(tmp_path / f"m{tamper}.dlmt"), HEADER, capture="confidence")
        sink = rec.sink(0, [0, 1])
        sink.on_start(canvas, {})
        for step, cols in enumerate(([True, True, False, False], [False, False, True, True]), 1):
            c = torch.tensor([cols, cols])
            _apply_and_emit(canvas, [sink], FrameDelta(
                step=step, nfe=1, start=g, commit=c, tokens=torch.full((2, 4), 40 + step),
                active=torch.ones(2, dtype=torch.bool), finished=torch.tensor([step == 2] * 2),
                confidence=torch.full((2, 4), 0.25 * step)))
        if tamper:                                  # e.g. a hook writing the canvas: no delta tells it
            canvas.tokens[1, g + 3] = 77
        sink.on_end(canvas)
        rec.close()
        tr = open_trace(tmp_path / f"m{tamper}.dlmt", recover=False)
        assert tr.batches[0].end["mismatch"] is tamper
        assert [s.tokens.tolist() for s in tr] == canvas.tokens[:, g:].tolist()
        assert tr[1].tokens.tolist() == [41, 41, 42, 77 if tamper else 42]
        assert tr[0].confidence.tolist() == [0.25, 0.25, 0.5, 0.5] and tr[0].step_of.tolist() == [1, 1, 2, 2]


def test_overwrite_inside_a_run_of_same_window_steps(tmp_path):
    """The writer applies same-window steps together; an overwrite among them must still be an edit."""
    mask = 3
    canvas = Canvas.from_prompts([[10], [11]], gen_length=4, mask_id=mask, pad_id=0)
    g = canvas.gen_start
    rec = TraceRecorder(str(tmp_path / "o.dlmt"), HEADER)
    states = StateSink()
    sinks = [rec.sink(0, [0, 1]), states]
    for s in sinks:
        s.on_start(canvas, {})
    T, F = True, False
    plan = [([[T, F, F, F], [T, F, F, F]], [[20, 0, 0, 0], [21, 0, 0, 0]]),
            ([[F, T, F, F], [T, F, F, F]], [[0, 22, 0, 0], [23, 0, 0, 0]]),    # row 1 overwrites column g
            ([[F, F, T, T], [F, T, T, T]], [[0, 0, 24, 25], [0, 26, 27, 28]])]
    for step, (c, t) in enumerate(plan, 1):
        _apply_and_emit(canvas, sinks, FrameDelta(step=step, nfe=1, start=g, commit=torch.tensor(c), tokens=torch.tensor(t),
                                                  active=torch.ones(2, dtype=torch.bool),
                                                  finished=torch.tensor([step == 3, step == 3])))
    for s in sinks:
        s.on_end(canvas)
    rec.close()
    tr = open_trace(tmp_path / "o.dlmt", recover=False)
    for i, s in enumerate(tr):
        for (tokens, _), d in zip(states.states, states.deltas):
            assert np.array_equal(s.canvas_at(d.step), tokens[i].numpy())
    assert tr[0].edits is None
    assert tr[1].edits["token"].tolist() == [21] and tr[1].edits["end"].tolist() == [2]


def test_diff_finds_the_first_divergence(lm, tmp_path):
    from dlm_engine.trace.tools import diff, first_divergence

    record_run(lm, tmp_path / "a.dlmt", "low_confidence", PROMPTS, batch_size=3)
    cls = STRATEGIES["low_confidence"]
    two_per_step = cls.Config(steps=8)
    record_run(lm, tmp_path / "b.dlmt", "low_confidence", PROMPTS, batch_size=3, make=lambda: cls(two_per_step, 16))
    a, b = open_trace(tmp_path / "a.dlmt"), open_trace(tmp_path / "b.dlmt")
    assert diff(a, a)["first"] is None and diff(a, a)["rows_identical"] == 3
    d = diff(a, b)
    assert d["first"] is not None and d["rows_compared"] == 3
    for sa, sb in zip(a, b):
        # brute force: the first step whose states differ, and the first differing position there
        expect = None
        for t in range(0, max(sa.n_steps, sb.n_steps) + 1):
            diffpos = np.flatnonzero(sa.state_at(t) != sb.state_at(t))
            if diffpos.size:
                expect = (t, int(diffpos[0]))
                break
        got = first_divergence(sa, sb)
        assert (None if got is None else (got["step"], got["position"])) == expect
        if got is not None:
            assert got["token_a"] == sa.state_at(got["step"])[got["position"]]
            assert got["token_b"] == sb.state_at(got["step"])[got["position"]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_confidence_of_any_float_dtype(tmp_path, dtype):
    canvas = Canvas.from_prompts([[10], [11]], gen_length=3, mask_id=3, pad_id=0)
    g = canvas.gen_start
    rec = TraceRecorder(str(tmp_path / "c.dlmt"), HEADER, capture="confidence")
    sinks = [rec.sink(0, [0, 1])]
    for s in sinks:
        s.on_start(canvas, {})
    conf = torch.tensor([[0.25, 0.5, 0.75], [1.0, 0.125, 0.375]], dtype=dtype)
    for step, cols in enumerate(([True, False, False], [False, True, True]), 1):
        c = torch.tensor([cols, cols])
        _apply_and_emit(canvas, sinks, FrameDelta(step=step, nfe=1, start=g, commit=c, tokens=torch.full((2, 3), 40 + step),
                                                  active=torch.ones(2, dtype=torch.bool), finished=torch.tensor([step == 2] * 2),
                                                  confidence=conf, scalars={"gap": conf.max(-1).values}))
    for s in sinks:
        s.on_end(canvas)
    rec.close()
    tr = open_trace(tmp_path / "c.dlmt", recover=False)
    assert tr[0].confidence.tolist() == [0.25, 0.5, 0.75] and tr[1].confidence.tolist() == [1.0, 0.125, 0.375]
    assert tr.batches[0].steps.scalars["gap"].tolist() == [[0.75, 1.0], [0.75, 1.0]]


@pytest.mark.parametrize("name", ["low_confidence", "threshold", "block_buffer", "d2c"])
def test_held_runs_of_any_length_write_the_same_trace(lm, tmp_path, monkeypatch, name):
    """The writer takes same-window deltas in runs (``HOLD`` deltas, at most ``HOLD_POSITIONS`` positions): the
    run length changes when the writes are logged, never what is written -- the same sequences
    (tokens, commit steps, confidences, NFE, finish steps) and step tables (wall time aside, a clock) with runs of
    one delta, of three, or capped by positions."""
    from dlm_engine.trace import recorder as R

    flushes = []
    orig = R.TraceRecorder._flush_held

    def counted(self, st):
        flushes.append(len(st.held))
        return orig(self, st)

    def content(tr):
        seqs = [(s.tokens.tolist(), s.step_of.tolist(), np.nan_to_num(s.confidence, nan=-1).tolist(), s.nfe,
                 s.finish_step) for s in tr]
        tabs = [(t.step.tolist(), t.nfe.tolist(), t.start.tolist(), t.width.tolist(), t.active.tolist(),
                 t.finished.tolist(), sorted((k, np.asarray(v).tolist()) for k, v in t.scalars.items()), t.events)
                for t in (tr.batches[k].steps for k in sorted(tr.batches))]
        # the writes the runs logged account for the canvas the decode ended with
        assert not any(tr.batches[k].end["mismatch"] for k in tr.batches)
        return repr((seqs, tabs))

    monkeypatch.setattr(R.TraceRecorder, "_flush_held", counted)
    got = {}
    for hold, positions in ((R.HOLD, R.HOLD_POSITIONS), (1, R.HOLD_POSITIONS), (3, R.HOLD_POSITIONS), (R.HOLD, 40)):
        monkeypatch.setattr(R, "HOLD", hold)
        monkeypatch.setattr(R, "HOLD_POSITIONS", positions)
        flushes.clear()
        path = tmp_path / f"{hold}-{positions}.dlmt"
        record_run(lm, path, name, PROMPTS, batch_size=2, capture="confidence", gen_length=32)
        tr = open_trace(path, recover=False)
        assert tr.ok
        got[(hold, positions)] = content(tr)
        if positions == 40:            # batches of 2 rows: runs of at most 40 // (2 * W) deltas (W >= 8 here)
            assert flushes and max(flushes) <= 40 // (2 * 8), flushes
        elif hold <= 3:
            assert flushes and max(flushes) <= hold
        else:
            assert max(flushes) > 3     # (the default makes longer runs here)
    assert len(set(got.values())) == 1


def _scalar_table(tmp_path, tag):
    """A batch of crafted same-window deltas (so the writer holds them in runs) whose per-step scalars take every
    path of the writer's step table: stacked tensors, Python ints / floats / bools, ints mixed with floats, a
    tensor whose shape changes, a name only some steps have, block events."""
    canvas = Canvas.from_prompts([[10], [11]], gen_length=8, mask_id=3, pad_id=0)
    g = canvas.gen_start
    rec = TraceRecorder(str(tmp_path / f"{tag}.dlmt"), HEADER)
    sink = rec.sink(0, [0, 1])
    sink.on_start(canvas, {})
    for step in range(1, 9):
        commit = torch.zeros(2, 8, dtype=torch.bool)
        commit[:, step - 1] = True
        scalars = {"t": torch.tensor([step, -step]), "i": step * 3, "f": step / 4, "b": step % 2 == 0,
                   "mix": step if step % 3 else step + 0.5, "shape": torch.zeros(step % 2 + 1)}
        if step in (2, 7):
            scalars["only"] = torch.tensor(step * 10)
        d = FrameDelta(step=step, nfe=1 + step % 2, start=g, commit=commit, tokens=torch.full((2, 8), 20 + step),
                       active=torch.tensor([True, step < 8]), finished=torch.tensor([step == 8, step >= 7]),
                       scalars=scalars, wall_time=step * 0.01,
                       block_events=[BlockEvent("opened", step, g, g + 8)] if step in (1, 5) else [])
        canvas.apply(d)
        sink.on_delta(d, canvas)
    sink.on_end(canvas)
    rec.close()
    return open_trace(tmp_path / f"{tag}.dlmt", recover=False).batches[0].steps


def test_step_tables_are_the_same_whatever_the_runs_and_chunks(tmp_path, monkeypatch):
    """The writer keeps a run of held steps by column and cuts tables every ``STEP_CHUNK`` steps (a run may be cut
    in two): neither may change a table, for any kind of per-step scalar."""
    from dlm_engine.trace import recorder as R

    got = []
    for hold, chunk in ((R.HOLD, R.STEP_CHUNK), (1, R.STEP_CHUNK), (3, R.STEP_CHUNK), (R.HOLD, 3), (3, 2), (1, 5),
                        (7, R.STEP_CHUNK), (7, 3)):     # (7 of 8: a run of 7, then one step on its own)
        monkeypatch.setattr(R, "HOLD", hold)
        monkeypatch.setattr(R, "STEP_CHUNK", chunk)
        st = _scalar_table(tmp_path, f"{hold}-{chunk}")
        got.append(repr((st.step.tolist(), st.nfe.tolist(), st.active.tolist(), st.finished.tolist(),
                         sorted((k, repr([np.asarray(x).tolist() for x in v])) for k, v in st.scalars.items()),
                         st.events)))
        assert st.step.tolist() == list(range(1, 9)) and st.nfe.tolist() == [1 + s % 2 for s in range(1, 9)]
        assert st.scalars["t"].tolist() == [[s, -s] for s in range(1, 9)]
        assert st.scalars["i"].tolist() == [3 * s for s in range(1, 9)] and st.scalars["i"].dtype.kind == "i"
        assert st.scalars["f"].tolist() == [s / 4 for s in range(1, 9)]
        assert st.scalars["b"].tolist() == [s % 2 == 0 for s in range(1, 9)]
        assert st.scalars["mix"].tolist() == [s if s % 3 else s + 0.5 for s in range(1, 9)]
        assert [np.asarray(v).tolist() for v in st.scalars["shape"]] == [[0.0] * (s % 2 + 1) for s in range(1, 9)]
        only = st.scalars["only"]
        assert [only[i] for i in (1, 6)] == [20, 70] and np.isnan(only[0]) and np.isnan(only[7])
        assert st.active.tolist()[-1] == [True, False] and st.finished.tolist()[-2] == [False, True]
        assert [(e[0], e[1]) for e in st.events] == [(1, "opened"), (5, "opened")]
    assert len(set(got)) == 1


def test_a_recorder_without_its_thread_writes_the_same_records(lm, tmp_path):
    """``threaded=False`` (profiling, debugging) does the writer's work inside each sink call: the records are
    those the writer thread writes (step tables compared without their wall times, a clock), ``writer_cpu`` sums
    that work, and a failure surfaces at the call that caused it."""
    from dlm_engine.trace.reader import scan_records

    out = {}
    for threaded in (True, False):
        path = tmp_path / f"{threaded}.dlmt"
        _, _, rec = record_run(lm, path, "threshold", PROMPTS, capture="confidence", threaded=threaded)
        assert (rec._thread is None) == (not threaded) and rec.writer_cpu > 0
        recs, damage = scan_records(path.read_bytes())
        assert damage is None
        tr = open_trace(path, recover=False)
        tabs = [(t.step.tolist(), t.nfe.tolist(), t.start.tolist(), t.width.tolist(), t.active.tolist(),
                 t.finished.tolist(), sorted((k, np.asarray(v).tolist()) for k, v in t.scalars.items()), t.events)
                for t in (tr.batches[k].steps for k in sorted(tr.batches))]
        out[threaded] = ([(r.kind, bytes(r.payload)) for r in recs if r.kind in (fmt.BATCH, fmt.SEQ)], repr(tabs))
    assert out[True] == out[False] and len(out[True][0]) >= 5
    rec = TraceRecorder(str(tmp_path / "small.dlmt"), {**HEADER, "shape": {"batch_size": 1}}, threaded=False)
    canvas = Canvas.from_prompts([[10], [11]], gen_length=4, mask_id=3, pad_id=0)
    with pytest.raises(fmt.TraceError, match="allows 1"):
        rec.sink(0, [0, 1]).on_start(canvas, {})
    with pytest.raises(fmt.TraceError, match="writer failed"):
        rec.close()
    assert not os.path.exists(tmp_path / "small.dlmt")


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_writer_thread_runs_at_the_lowest_priority_and_the_loop_keeps_its_own(lm, tmp_path):
    """The writer thread takes nice 19 for itself alone (the model's threads get a core before it); the step loop's
    thread keeps its priority; ``writer_nice=None`` leaves the writer at the process' own; each trace opens."""
    import threading

    from dlm_engine.trace.recorder import WRITER_NICE

    me = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, me)
    for nice in (WRITER_NICE, None):
        path = tmp_path / f"{nice}.dlmt"
        rec = TraceRecorder(str(path), HEADER, writer_nice=nice)
        for _ in range(200):                                 # (the thread sets it when it starts)
            if rec.writer_tid is not None or nice is None:
                break
            __import__("time").sleep(0.01)
        if nice is None:
            assert rec.writer_tid is None
        else:
            assert rec.writer_tid not in (None, me)
            assert os.getpriority(os.PRIO_PROCESS, rec.writer_tid) == WRITER_NICE == 19
        assert os.getpriority(os.PRIO_PROCESS, me) == before
        rec.close()
        assert open_trace(path, recover=False) is not None
    assert os.getpriority(os.PRIO_PROCESS, me) == before
    _, _, rec = record_run(lm, tmp_path / "run.dlmt", "low_confidence", PROMPTS)
    assert rec.writer_tid is not None and os.getpriority(os.PRIO_PROCESS, me) == before
