"""A real 2x2 sweep with hydra/launcher=submitit_local (the SLURM launcher's local mode): each job runs in its
own process and writes its own result.json; the callback in the launching process aggregates them from disk.
(Resume is launcher-independent: the job itself checks its result.json; see test_sweep.py.)"""
import csv
import json

import pytest

from conftest import run_dlm

pytestmark = pytest.mark.slow     # starts processes (see pyproject.toml's markers)

ARGS = ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", "strategy=threshold",
        "strategy.threshold=0.5,0.9", "strategy.block_length=8,16", 'prompts=["12+34=","name a fruit:"]',
        "gen_length=16", "device=cpu", "trace.record=false", "print_outputs=false"]


def test_submitit_local_2x2_sweep(tmp_path):
    d = tmp_path / "sw"
    proc = run_dlm(["-m", f"hydra.sweep.dir={d}", *ARGS], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in d.glob("*/result.json")]
    assert len(results) == 4
    assert {(r["strategy"]["threshold"], r["strategy"]["block_length"]) for r in results} == {
        (0.5, 8), (0.5, 16), (0.9, 8), (0.9, 16)}
    assert all(r["metrics"]["prompts"] == 2 and "accuracy" not in r["metrics"] for r in results)
    with open(d / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(r["status"] == "ok" and float(r["tps"]) > 0 for r in rows)
    assert (d / "tps.png").is_file() and not (d / "accuracy_vs_nfe.png").exists()  # no checker, no accuracy
    assert "no accuracy in the results" in proc.stdout
    assert list(d.glob(".submitit/*/*_log.out"))  # the jobs really ran through submitit
