"""A real 2x2 `dlm -m` sweep with Hydra's basic launcher: result.json per job, the end-of-multirun table and
plots, idempotent resume, and `dlm-sweep` on a partial sweep."""
import csv
import json

import pytest

from conftest import run_dlm

pytestmark = pytest.mark.slow     # starts processes (see pyproject.toml's markers)

SWEEP = ["strategy=threshold", "strategy.threshold=0.5,0.9", "strategy.block_length=range(8,17,8)",
         "task=tiny_mix", "task.n=8", "gen_length=16", "device=cpu"]


def _results(sweep_dir):
    return {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("*/result.json")}


def _csv(sweep_dir):
    with open(sweep_dir / "sweep.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    d = tmp / "sw"
    proc = run_dlm(["-m", f"hydra.sweep.dir={d}", *SWEEP], cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp, d, proc


def test_cartesian_product_writes_one_result_per_job(sweep):
    _, d, _ = sweep
    res = _results(d)
    assert len(res) == 4
    combos = {(r["strategy"]["threshold"], r["strategy"]["block_length"]) for r in res.values()}
    assert combos == {(0.5, 8), (0.5, 16), (0.9, 8), (0.9, 16)}  # range(8,17,8) -> 8, 16
    for name, r in res.items():
        # the job directory is named after its overrides (sorted), so a re-run finds it again
        assert name == ",".join(sorted(o for o in r["overrides"] if not o.startswith("print_outputs="))), name
        assert r["status"] == "ok" and r["strategy"]["name"] == "threshold" and r["cache"]["name"] == "none"
        assert r["model"] == "tiny" and r["task"] == "tiny_mix"
        m = r["metrics"]
        for key in ("accuracy", "nfe", "nfe_per_prompt", "tpf", "tps", "wall_time", "job_time", "generated_tokens"):
            assert isinstance(m[key], (int, float)), key
        assert m["prompts"] == 8 and set(m["accuracy_by_task"]) == {"add", "sub", "pick", "split"}
        assert r["versions"]["dlm_engine"] and r["versions"]["torch"]
        assert r["config_digest"].startswith("sha256:") and r["config"]["gen_length"] == 16
        # the trace named in result.json exists next to it and has the recorded digest
        import hashlib

        trace = d / name / r["trace"]["path"]
        assert trace.is_file()
        assert r["trace"]["digest"] == "sha256:" + hashlib.sha256(trace.read_bytes()).hexdigest()


def test_end_of_multirun_callback_writes_table_and_plots(sweep):
    _, d, proc = sweep
    rows = _csv(d)
    assert len(rows) == 4
    assert {(r["strategy.threshold"], r["strategy.block_length"]) for r in rows} == {
        ("0.5", "8"), ("0.5", "16"), ("0.9", "8"), ("0.9", "16")}
    res = _results(d)
    for row in rows:
        r = res[row["job"]]
        assert row["status"] == "ok" and row["strategy"] == "threshold"
        assert float(row["nfe_per_prompt"]) == pytest.approx(r["metrics"]["nfe_per_prompt"])
        assert float(row["accuracy"]) == pytest.approx(r["metrics"]["accuracy"])
        assert float(row["tps"]) == pytest.approx(r["metrics"]["tps"])
        assert row["trace_digest"] == r["trace"]["digest"]
        assert row["pareto"] in ("True", "False")
    assert any(r["pareto"] == "True" for r in rows)
    for png in ("accuracy_vs_nfe.png", "tps.png"):
        assert (d / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert "4 jobs (4 ok)" in proc.stdout and "strategy.threshold" in (d / "sweep.md").read_text()
    # a multirun prints one summary line per job, not one line per prompt
    assert sum(line.startswith("accuracy ") for line in proc.stdout.splitlines()) == 4
    assert "-> '" not in proc.stdout
    # workers have no terminal: a log line per batch instead of a progress bar, in the job's log
    log = next(d.glob("*/cli.log")).read_text()
    assert "decoded 8/8 prompts" in log


def test_rerun_skips_finished_jobs_and_says_so(sweep):
    tmp, d, _ = sweep
    before = {p: p.stat().st_mtime_ns for p in d.glob("*/result.json")}
    proc = run_dlm(["-m", f"hydra.sweep.dir={d}", *SWEEP], cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming sweep" in proc.stdout and "4 finished job(s)" in proc.stdout
    assert proc.stdout.count("skipped, result.json exists") == 4
    assert "sequences 8  NFE" not in proc.stdout  # nothing was decoded
    assert {p: p.stat().st_mtime_ns for p in d.glob("*/result.json")} == before
    assert len(_csv(d)) == 4


def test_dlm_sweep_on_partial_sweep_then_resume_runs_only_the_missing_jobs(sweep):
    import shutil

    tmp, d, _ = sweep
    victim, gone = sorted(d.glob("*/result.json"))[:2]
    victim.unlink()                 # killed while running: its directory has no result
    shutil.rmtree(gone.parent)      # never started: no directory at all (the grid is in multirun.yaml)
    (d / "sweep.csv").unlink()
    proc = run_dlm([str(d)], cwd=tmp, exe="dlm-sweep")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {r["job"]: r for r in _csv(d)}
    assert len(rows) == 4 and rows[victim.parent.name]["status"] == "incomplete"
    assert rows[gone.parent.name]["status"] == "not started"
    # the incomplete job's settings come from its .hydra/config.yaml, the missing one's from the grid
    assert rows[victim.parent.name]["strategy.threshold"] in ("0.5", "0.9")
    assert rows[gone.parent.name]["strategy.block_length"] in ("8", "16")
    assert "1 incomplete" in proc.stdout and "1 not started" in proc.stdout and "hydra.sweep.dir=" in proc.stdout
    assert f"not started: {gone.parent.name}" in proc.stdout

    proc = run_dlm(["-m", f"hydra.sweep.dir={d}", *SWEEP], cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("skipped, result.json exists") == 2
    assert proc.stdout.count("sequences 8  NFE") == 2
    assert victim.is_file() and gone.is_file() and all(r["status"] == "ok" for r in _csv(d))
    assert run_dlm([str(d)], cwd=tmp, exe="dlm-sweep").returncode == 0  # complete now
