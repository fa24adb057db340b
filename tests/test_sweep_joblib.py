"""A real 2x2 sweep with hydra/launcher=joblib (n_jobs=2): every worker writes its own result.json, the
end-of-multirun callback aggregates them from disk, workers log progress lines instead of bars."""
import csv
import json

import pytest

from conftest import run_dlm

pytestmark = pytest.mark.slow     # starts processes (see pyproject.toml's markers)


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


def _children(pid):
    import os

    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid):

    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
    return True


def test_killed_joblib_sweep_leaves_no_workers_running(tmp_path):
    """SIGKILL the `dlm -m` process while both workers decode: they notice their parent is gone and end."""
    import os
    import signal
    import subprocess
    import time

    from conftest import BIN

    d = tmp_path / "sw"
    proc = subprocess.Popen([str(BIN / "dlm"), "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                             f"hydra.sweep.dir={d}", "seed=0,1", "strategy.steps=64", "task.n=2000", "batch_size=1",
                             "trace.record=false", "device=cpu"], cwd=str(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    try:
        deadline = time.time() + 240
        while len(list(d.glob("*/cli.log"))) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert len(list(d.glob("*/cli.log"))) == 2, "the two jobs did not start"
        workers = [p for p in _children(proc.pid) if "loky" in open(f"/proc/{p}/cmdline").read()]
        assert workers
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 90
    while any(_alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.5)
    left = [p for p in workers if _alive(p)]
    for p in left:  # do not leave them behind even when the check fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers still running after their sweep was killed: {left}"
