"""One writer per run directory: a held directory is refused (single run) or skipped (sweep job), and two
sweeps into one directory at once leave every job's trace matching its result.json digest."""
import hashlib
import json
import os
import subprocess

import pytest

from conftest import BIN, run_dlm
from dlm_engine.fsutil import DirLock

SWEEP = ["strategy=threshold", "strategy.threshold=0.5,0.7,0.9", "task=tiny_mix", "task.n=6", "gen_length=16",
         "device=cpu", "print_outputs=false", "hydra.callbacks.sweep.plots=false"]


def test_dir_lock_is_exclusive_and_names_its_holder(tmp_path):
    a, b = DirLock(tmp_path), DirLock(tmp_path)
    assert a.acquire()
    assert not b.acquire()                               # another open file description: refused
    assert f"pid {os.getpid()} on " in b.holder()
    a.release()
    assert b.acquire()                                   # released: free again (the file itself stays)
    b.release()
    assert (tmp_path / ".dlm.lock").is_file()


@pytest.mark.slow
def test_a_held_run_directory_fails_fast_and_is_left_alone(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("the other process's file")
    lock = DirLock(out)
    assert lock.acquire()
    try:
        proc = run_dlm([f"hydra.run.dir={out}", "device=cpu", "prompts=[hi]"], cwd=tmp_path)
    finally:
        lock.release()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"run directory {out} is in use by pid {os.getpid()}" in lines[0]
    assert (out / "keep.txt").is_file()                  # not removed: it belongs to the holder
    assert not (out / "summary.json").exists() and not list(out.glob("trace.dlmt*"))


@pytest.mark.slow
def test_a_held_sweep_job_is_skipped_and_the_others_run(tmp_path):
    from dlm_engine.app.jobs import job_dirname

    d = tmp_path / "sw"
    common = ["strategy=threshold", "task=tiny_mix", "task.n=2", "device=cpu"]
    held = d / job_dirname(common + ["strategy.threshold=0.5"])
    held.mkdir(parents=True)
    lock = DirLock(held)
    assert lock.acquire()
    try:
        proc = run_dlm(["-m", f"hydra.sweep.dir={d}", "strategy.threshold=0.5,0.9", *common, "print_outputs=false",
                        "hydra.callbacks.sweep.plots=false"], cwd=tmp_path)
    finally:
        lock.release()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"skipped, {held} is in use by pid {os.getpid()}" in proc.stdout
    assert not (held / "result.json").exists()
    assert (d / job_dirname(common + ["strategy.threshold=0.9"]) / "result.json").is_file()


@pytest.mark.slow
def test_two_sweeps_into_one_directory_at_once(tmp_path):
    d = tmp_path / "sw"
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    procs = [subprocess.Popen([str(BIN / "dlm"), "-m", f"hydra.sweep.dir={d}", *SWEEP], cwd=str(tmp_path), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-2000:]
    results = sorted(d.glob("*/result.json"))
    assert len(results) == 3
    for r in results:
        res = json.loads(r.read_text())
        trace = r.parent / res["trace"]["path"]
        assert res["status"] == "ok" and trace.is_file() and not trace.with_name(trace.name + ".partial").exists()
        assert res["trace"]["digest"] == "sha256:" + hashlib.sha256(trace.read_bytes()).hexdigest(), r
        summary = json.loads((r.parent / "summary.json").read_text())
        assert summary["trace_digest"] == res["trace"]["digest"]
    decoded = sum(o.count("sequences 6  NFE/seq") for o, _ in outs)
    assert decoded == 3                                  # every job decoded by exactly one of the two
