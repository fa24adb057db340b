"""Issue 49 item 5: one per-step table. A batch's step, NFE, wall time, active / finished rows and step scalars are
taken from its deltas once, into one :class:`~dlm_engine.core.steps.BatchSteps`: the per-sequence metrics read it and
the trace recorder writes slices of it (its writer keeps only its own columns beside: window start / width, block
events). A decode builds exactly one table a batch, traced or not, in ``dlm``, ``Session`` and ``dlm-serve``; the
trace's step records hold the table's values."""
import json

import numpy as np
import pytest
import torch

import dlm_engine
from dlm_engine.core import steps as steps_mod


@pytest.fixture
def tables(monkeypatch):
    """Every BatchSteps built while the test runs, in order."""
    made = []
    real = steps_mod.BatchSteps.__init__

    def init(self, *a, **k):
        made.append(self)
        real(self, *a, **k)

    monkeypatch.setattr(steps_mod.BatchSteps, "__init__", init)
    return made


def assert_trace_holds(path, tables):
    """The trace's step records of batch i are table i's rows (the values the metrics read)."""
    from dlm_engine.trace import open_trace

    tr = open_trace(str(path), recover=False)
    assert sorted(tr.batches) == list(range(len(tables)))
    for i, t in enumerate(tables):
        st = tr.batches[i].steps
        n = len(t)
        assert n == len(st) > 0
        assert st.step.tolist() == t.step and st.nfe.tolist() == t.nfe
        assert np.array_equal(st.active, torch.stack(t.active).bool().numpy())
        assert np.array_equal(st.finished, torch.stack(t.finished).bool().numpy())
        # (wall times are stored to within 1/16 of each step's duration)
        assert np.allclose(st.wall_time, t.wall, rtol=0.1, atol=1e-3)
        names = {k for s in t.scalars for k in s}
        assert names and names == set(st.scalars)
        for k in names:
            want = [s.get(k) for s in t.scalars]
            if all(isinstance(v, torch.Tensor) for v in want):
                assert np.array_equal(np.asarray(st.scalars[k]), torch.stack(want).numpy()), k
    return tr


@pytest.mark.parametrize("record", [False, True])
def test_a_dlm_run_builds_one_step_table_a_batch(tables, tmp_path, record):
    from dlm_engine.app.compose import compose
    from dlm_engine.app.run import run

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("12+34=\n901-256=\nname a fruit:\nsum 9:\n5+5=\n")
    cfg = compose(["model=tiny", "device=cpu", "strategy=threshold", "cache=dual", "gen_length=8", "batch_size=2",
                   f"prompts_file={prompts}", f"trace.record={str(record).lower()}", "progress=false",
                   "print_outputs=false"])
    out = tmp_path / "run"
    out.mkdir()
    run(cfg, out)
    assert len(tables) == 3                                   # three batches of at most 2: one table each
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # the metrics read these tables: every row's NFE is the sum over the steps its row was active in
    for t, chunk in zip(tables, (rows[0:2], rows[2:4], rows[4:5])):
        act = torch.stack(t.active).bool().numpy()
        nfe = np.asarray(t.nfe)
        assert [r["nfe"] for r in chunk] == [int(nfe[act[:, b] & (np.asarray(t.step) <= r["steps"])].sum())
                                             for b, r in enumerate(chunk)]
    if record:
        tr = assert_trace_holds(out / "trace.dlmt", tables)
        assert [s.nfe for s in tr] == [r["nfe"] for r in rows]


def test_a_session_call_with_a_trace_builds_one_step_table_a_batch(tables, tmp_path):
    s = dlm_engine.Session(model="tiny", device="cpu")
    out = s.generate(["12+34=", "901-256=", "5+5="], strategy="edit", gen_length=8, batch_size=2,
                     trace=tmp_path / "t.dlmt")
    assert len(out) == 3 and len(tables) >= 2
    assert_trace_holds(tmp_path / "t.dlmt", tables)     # (one table a batch: as many as the trace's batches)
    assert sum(r.edits for r in out.rows) > 0       # (the metrics' edits: the table's `edits` scalar)


def test_the_recorder_writes_the_tables_rows_not_a_copy_of_its_own(tmp_path):
    """The writer reads the step facts from the batch's table: a value only the table has reaches the file (a
    writer that built its own per-step list from the deltas would miss it), threaded or not."""
    from dlm_engine.app.api import load_directory, run_prompts
    from dlm_engine.core.registry import cache_class, strategy_class
    from dlm_engine.trace import TraceRecorder, open_trace

    class Tagged(steps_mod.BatchSteps):
        def append(self, delta):
            delta_scalars, n = delta.scalars, len(self)
            delta.scalars = dict(delta_scalars, table_row=n)       # (the row as the table keeps it)
            try:
                return super().append(delta)
            finally:
                delta.scalars = delta_scalars

    lm = load_directory()
    S, C = strategy_class("low_confidence"), cache_class("none")
    header = {"model": {"name": "tiny", "eos_id": lm.eos_id, "mask_id": lm.mask_id}, "config": {}}
    for threaded in (True, False):
        path = tmp_path / f"t{threaded}.dlmt"
        kept = []

        def sinks(b, rows):
            kept.append(Tagged())
            return [rec.sink(b, rows, table=kept[-1])]

        with TraceRecorder(str(path), header, threaded=threaded) as rec:
            stats = run_prompts(lm, ["12+34=", "5+5=", "sum 9:"], lambda: S(S.Config(steps=8), 8),
                                lambda: C(C.Config()), 8, 2, sinks_for_batch=sinks, warmup=False)
        assert len(stats.rows) == 3 and len(kept) == 2
        tr = open_trace(str(path), recover=False)
        for i, t in enumerate(kept):
            assert tr.batches[i].steps.scalars["table_row"].tolist() == list(range(len(t))), threaded


@pytest.mark.slow
def test_dlm_serve_builds_one_step_table_a_batch(tables, tmp_path):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("sse_starlette")
    httpx = pytest.importorskip("httpx")
    from dlm_engine.serve.cli import ServerThread

    with ServerThread(["device=cpu", "max_batch_wait=0.05", "trace.record=true"], tmp_path) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            body = c.post("/v1/completions", json={"prompt": ["347+085=", "901-256="], "max_tokens": 16}).json()
    assert len(tables) == 1                           # the two prompts decode as one batch: one table
    assert_trace_holds(body["dlm"]["trace"], tables)
