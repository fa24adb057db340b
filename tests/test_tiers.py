"""The test tiers: ``slow``, ``parity`` and ``cuda`` are registered markers (``--strict-markers`` refuses others), a quick test
that starts a process fails with the line that says to mark it, and ``cuda`` tests are skipped without a device."""
import shutil
import subprocess
import sys

import pytest
import torch


def test_the_markers_are_registered(pytestconfig):
    assert {m.split(":")[0] for m in pytestconfig.getini("markers")} >= {"slow", "parity", "cuda"}
    assert "--strict-markers" in pytestconfig.getini("addopts")


def test_a_quick_test_that_starts_a_process_fails_saying_so():
    with pytest.raises(pytest.fail.Exception, match=r"starts a process \(python[\d.]*\): mark it @pytest.mark.slow"):
        subprocess.run([sys.executable, "-c", "pass"])
    if shutil.which("git"):                                     # the trace header's git stays allowed
        assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_slow_test_may_start_one():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


@pytest.mark.cuda
def test_a_cuda_test_runs_only_where_there_is_a_device():
    assert torch.cuda.is_available()
