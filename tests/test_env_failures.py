"""Environment failures: an output path that cannot be a directory, a full disk (a file-size limit gives the
same failed writes), a killed re-run. One line naming the path and the errno text, exit != 0, nothing left
that looks complete; an earlier run's complete files are set aside before a re-run writes anything."""
import errno
import os
import resource
import signal
import subprocess
import time

import pytest

from conftest import BIN, run_dlm
from dlm_engine import fsutil

COMPLETE = ("summary.json", "results.jsonl", "trace.dlmt", "result.json")


@pytest.mark.slow
def test_output_path_through_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "run"
    proc = run_dlm([f"hydra.run.dir={out}", "device=cpu", "prompts=[hi]"], cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines == [f"dlm: error: {out}: Not a directory"], proc.stderr


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_leaves_nothing_complete(tmp_path):
    """RLIMIT_FSIZE makes every write past 4.5 KB fail with EFBIG, as a full disk fails with ENOSPC: Hydra's
    small files fit, the outputs of 100 prompts (trace, results) do not."""
    out = tmp_path / "run"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4500, 4500))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    proc = subprocess.run([str(BIN / "dlm"), f"hydra.run.dir={out}", "device=cpu", "prompts=[" + ",".join(f"p{i}" for i in range(100)) + "]"],
                          cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300, preexec_fn=limit)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert str(out) in lines[0] and os.strerror(errno.EFBIG) in lines[0], lines
    assert not any((out / n).exists() for n in COMPLETE)


@pytest.mark.slow
def test_a_killed_rerun_leaves_no_earlier_complete_files_beside_its_partial(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for n in COMPLETE:                                   # an earlier run's complete outputs
        (out / n).write_text(f"earlier {n}")
    n = 200
    prompts = "prompts=[" + ",".join(f"p{i}" for i in range(n)) + "]"
    proc = subprocess.Popen([str(BIN / "dlm"), f"hydra.run.dir={out}", "device=cpu", prompts, "batch_size=1",
                             "gen_length=48"], cwd=str(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, HYDRA_FULL_ERROR="0"))
    deadline = time.time() + 120
    try:
        while not (out / "trace.dlmt.partial").exists():
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any((out / n).exists() for n in COMPLETE), sorted(p.name for p in out.iterdir())
    assert sorted(p.name for p in (out / ".previous").iterdir()) == sorted(COMPLETE)
    assert (out / ".previous" / "summary.json").read_text() == "earlier summary.json"


def test_set_aside_replaces_an_older_previous_and_drop_removes_it(tmp_path):
    (tmp_path / "summary.json").write_text("1")
    assert fsutil.set_aside(tmp_path, ["summary.json", "missing.json"]) == ["summary.json"]
    (tmp_path / "summary.json").write_text("2")
    fsutil.set_aside(tmp_path, ["summary.json"])
    assert (tmp_path / ".previous" / "summary.json").read_text() == "2" and not (tmp_path / "summary.json").exists()
    assert fsutil.set_aside(tmp_path, ["summary.json"]) == []     # nothing to move: .previous is kept
    assert (tmp_path / ".previous" / "summary.json").is_file()
    fsutil.drop_previous(tmp_path)
    assert not (tmp_path / ".previous").exists()


def test_failed_writes_name_the_file(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))   # what fsync on a full disk raises: no file name

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as exc:
        fsutil.atomic_write_json(str(tmp_path / "summary.json"), {"a": 1})
    assert fsutil.os_error_message(exc.value) == f"{tmp_path / 'summary.json'}: No space left on device"
    assert list(tmp_path.iterdir()) == []
    assert fsutil.os_error_message(OSError(errno.EROFS, os.strerror(errno.EROFS)), "/x") == "/x: Read-only file system"
