"""Issue 48 item 5: edits in metrics and traces -- per-sequence edits and post-edit NFE (batch-invariant like the
other metrics), every edit in the trace's edit stream (position, old token, step it was replaced), and the
trace tools (show, replay --step, diff, html) on an edit run of the tiny LLaDA2.1 fixture model."""
import json

import numpy as np
import pytest

from conftest import FIXTURES
from dlm_engine.metrics import batch_metrics, summary_line, totals

BD = FIXTURES / "bdparity"
KW = dict(block_length=8, threshold=0.9, editing_threshold=0.1, max_post_steps=4)


def test_edits_and_post_edit_nfe_count_only_the_steps_a_row_took_part_in():
    steps = np.arange(1, 6)
    active = np.array([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0]], bool)
    finished = np.array([[0, 0], [0, 0], [0, 0], [0, 1], [1, 0]], bool)
    edits = np.array([[0, 0], [2, 5], [1, 1], [0, 3], [4, 9]])       # row 1 sat out steps 2 and 5, finished at 4
    post = np.array([0, 0, 1, 1, 1])
    so = np.ones((2, 4), np.int64)
    m = batch_metrics(steps, np.ones(5, np.int64), active, finished, np.zeros(5), so, np.zeros((2, 4), np.int64),
                      None, edits=edits, post_edit=post)
    assert (m[0].edits, m[0].post_edit_nfe, m[0].nfe) == (7, 3, 5)
    assert (m[1].edits, m[1].post_edit_nfe, m[1].nfe) == (4, 2, 3)
    # alone in a batch, row 1 gets the same figures
    alone = batch_metrics(steps[[0, 2, 3]], np.ones(3, np.int64), active[[0, 2, 3], 1:], finished[[0, 2, 3], 1:],
                          np.zeros(3), so[1:], np.zeros((1, 4), np.int64), None, edits=edits[[0, 2, 3], 1:],
                          post_edit=post[[0, 2, 3]])
    assert (alone[0].edits, alone[0].post_edit_nfe) == (4, 2)
    t = totals(m)
    assert (t.edits, t.post_edit_nfe) == (11, 5) and t.as_dict()["edits_per_sequence"] == 5.5
    assert "edits/seq 5.50  post-edit NFE/seq 2.50" in summary_line(t)
    assert "edits" not in totals(batch_metrics(steps, np.ones(5, np.int64), active, finished, np.zeros(5), so,
                                               np.zeros((2, 4), np.int64), None)).as_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Edit runs of three prompts traced at batch 1 and batch 3 (decode_batch splits), and one at another
    editing threshold."""
    from dlm_engine.app.api import load_directory, run_prompts
    from dlm_engine.core.registry import cache_class, load_plugins, strategy_class
    from dlm_engine.trace import TraceRecorder

    load_plugins()
    lm = load_directory(str(BD / "tiny_llada21"))
    prompts = json.loads((BD / "llada21.json").read_text())["prompts"][1:4]
    S, C = strategy_class("edit"), cache_class("none")
    d = tmp_path_factory.mktemp("edit_trace")
    header = {"model": {"name": "tiny_llada21", "eos_id": lm.eos_id, "mask_id": lm.mask_id}, "config": {}}
    out = {}
    for name, bs, kw in (("b1", 1, KW), ("b3", 3, KW), ("other", 1, dict(KW, editing_threshold=0.5))):
        with TraceRecorder(str(d / f"{name}.dlmt"), header, capture="confidence") as rec:
            stats = run_prompts(lm, prompts, lambda: S(S.Config(**kw), 32), lambda: C(C.Config()), 32, bs,
                                sinks_for_batch=lambda b, rows: [rec.sink(b, rows)], warmup=False)
        out[name] = (d / f"{name}.dlmt", stats)
    return out


def test_run_metrics_count_edits_and_post_edit_nfe_batch_invariantly(runs):
    from dlm_engine.trace import open_trace

    (_, s1), (p3, s3) = runs["b1"], runs["b3"]
    for a, b in zip(s1.rows, s3.rows):
        assert (a.edits, a.post_edit_nfe, a.nfe) == (b.edits, b.post_edit_nfe, b.nfe)
        assert "edits" in a.metrics and a.post_edit_nfe <= a.nfe
    assert sum(r.edits for r in s1.rows) > 5 and sum(r.post_edit_nfe for r in s1.rows) > 0
    assert s1.totals.as_dict()["edits"] == sum(r.edits for r in s1.rows)
    # the trace's figures are the run's, and every edit is in the sequence's edit stream
    tr = open_trace(p3)
    for seq, row in zip(tr, s3.rows):
        m = seq.metrics
        assert (m.edits, m.post_edit_nfe, m.nfe) == (row.edits, row.post_edit_nfe, row.nfe)
        n_stream = 0 if seq.edits is None else len(seq.edits["col"])
        assert n_stream == row.edits                        # edit never re-masks: every record is an overwrite
    assert tr.totals().edits == s3.totals.edits


def test_each_edit_is_in_the_trace_and_replay_shows_the_canvas_as_it_was(runs, capsys):
    from dlm_engine.trace import open_trace
    from dlm_engine.trace.cli import main as trace_main

    path = runs["b1"][0]
    tr = open_trace(path)
    mask = tr.header["model"]["mask_id"]
    seq = next(s for s in tr if s.edits is not None and len(s.edits["col"]))
    e = seq.edits
    col, old, start, end = (int(e[k][0]) for k in ("col", "token", "start", "end"))
    p = col - seq.gen_start if col >= seq.gen_start else col
    assert old != mask and start >= 1 and end > start
    assert seq.state_at(end - 1)[p] == old and seq.state_at(end)[p] not in (old, mask)
    capsys.readouterr()
    assert trace_main(["replay", str(path), "--step", str(end - 1), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert next(r for r in rows if r["row"] == seq.row)["tokens"][p] == old
    assert trace_main(["replay", str(path), "--step", str(end), "--json"]) == 0
    assert p in next(r for r in json.loads(capsys.readouterr().out) if r["row"] == seq.row)["edited"]
    assert trace_main(["replay", str(path), "--step", str(end)]) == 0
    assert "edited by then" in capsys.readouterr().out
    assert trace_main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "edits" in out.splitlines()[next(i for i, l in enumerate(out.splitlines()) if l.split()[:1] == ["row"])]
    assert "edits/seq" in out and "post-edit NFE/seq" in out
    # each edit: step, position, old -> new token, confidence
    from dlm_engine.trace.tools import edit_events
    ev = edit_events(seq)
    assert len(ev) == len(e["col"]) and all(x["kind"] == "edit" and x["new"] != x["old"] for x in ev)
    for x in ev:
        assert seq.state_at(x["step"] - 1)[x["position"]] == x["old"] and seq.state_at(x["step"])[x["position"]] == x["new"]
    assert all(x["confidence"] is not None and x["confidence"] > KW["editing_threshold"] for x in ev)
    assert trace_main(["show", str(path), "--seq", str(list(tr).index(seq)), "--edits"]) == 0
    out = capsys.readouterr().out
    assert f"edits of row {seq.row}: {len(ev)} writes over a written token, 0 re-masks" in out


def test_diff_reports_the_first_divergence_of_two_edit_runs(runs, capsys):
    from dlm_engine.trace.cli import main as trace_main

    capsys.readouterr()
    assert trace_main(["diff", str(runs["b1"][0]), str(runs["b3"][0])]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert trace_main(["diff", str(runs["b1"][0]), str(runs["other"][0])]) == 1
    out = capsys.readouterr().out
    assert "first divergence: row" in out
    from dlm_engine.trace import open_trace
    from dlm_engine.trace.tools import diff
    d = diff(open_trace(runs["b1"][0]), open_trace(runs["other"][0]))["first"]
    assert d is not None and (d["kind"] is None or "edit" in d["kind"])


def test_the_html_page_holds_each_positions_edits(runs, tmp_path):
    from dlm_engine.trace import open_trace
    from dlm_engine.trace.tools import to_html

    tr = open_trace(runs["b1"][0])
    page = to_html(tr)
    seq = next(s for s in tr if s.edits is not None and len(s.edits["col"]))
    assert '"edits": [[' in page and "history: " in page and "' ed'" in page and '"nedit": ' in page
    assert str(int(seq.edits["token"][0])) in page


@pytest.mark.slow
def test_an_edit_run_through_dlm_is_reproduced_by_verify_rerun(tmp_path):
    """`dlm` with strategy=edit on the tiny LLaDA2.1 checkpoint: results.jsonl and summary.json carry edits and
    post-edit NFE, `show --edits` lists them, `verify --rerun` reproduces every step and token (edits included)."""
    from conftest import run_dlm

    model = BD / "tiny_llada21"
    prompts = json.dumps(json.loads((BD / "llada21.json").read_text())["prompts"][1:3])
    out = tmp_path / "run"
    proc = run_dlm(["model=local", f"model.path={model}", "strategy=edit", "strategy.block_length=8",
                    "strategy.editing_threshold=0.1", "strategy.threshold=0.9", "gen_length=32", f"prompts={prompts}",
                    f"hydra.run.dir={out}", "device=cpu"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert all(r["edits"] > 0 and 0 < r["post_edit_nfe"] <= r["nfe"] for r in rows)
    assert summary["edits"] == sum(r["edits"] for r in rows) and summary["post_edit_nfe"] == sum(
        r["post_edit_nfe"] for r in rows)
    trace = str(out / "trace.dlmt")
    show = run_dlm(["show", trace, "--edits"], cwd=tmp_path, exe="dlm-trace")
    assert show.returncode == 0 and "writes over a written token" in show.stdout and "edits/seq" in show.stdout
    ver = run_dlm(["verify", "--rerun", "--model-path", str(model), trace], cwd=tmp_path, exe="dlm-trace")
    assert ver.returncode == 0 and "reproduced" in ver.stdout, ver.stdout + ver.stderr
