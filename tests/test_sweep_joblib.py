"""A real 2x2 sweep with hydra/launcher=joblib (n_jobs=2): every worker writes its own result.json, the
end-of-multirun callback aggregates them from disk, workers log progress lines instead of bars."""
import csv
import json

from conftest import run_dlm


def test_joblib_2x2_sweep(tmp_path):
    d = tmp_path / "sw"
    proc = run_dlm(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={d}",
                    "strategy=threshold", "strategy.threshold=0.5,0.9", "strategy.block_length=8,16",
                    "task=tiny_mix", "task.n=8", "gen_length=16", "device=cpu", "trace.record=false",
                    "print_outputs=false"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in d.glob("*/result.json")]
    assert len(results) == 4 and len({r["job"]["num"] for r in results}) == 4
    assert {(r["strategy"]["threshold"], r["strategy"]["block_length"]) for r in results} == {
        (0.5, 8), (0.5, 16), (0.9, 8), (0.9, 16)}
    assert all(r["trace"] is None and "accuracy" in r["metrics"] for r in results)
    with open(d / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert {(r["strategy.threshold"], r["strategy.block_length"]) for r in rows} == {
        ("0.5", "8"), ("0.5", "16"), ("0.9", "8"), ("0.9", "16")}
    assert (d / "accuracy_vs_nfe.png").is_file() and (d / "tps.png").is_file()
    for log in d.glob("*/cli.log"):  # a joblib worker never draws a bar; it logs its progress
        assert "decoded 8/8 prompts" in log.read_text()
    assert "decode:" not in proc.stderr  # no tqdm bar
