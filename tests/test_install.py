"""Configs ship inside the package: a non-editable install finds them from any working directory."""
import os
import subprocess
import sys

from conftest import ROOT


def test_non_editable_install_finds_configs(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True, timeout=600)
    assert (target / "dlm_engine" / "conf" / "config.yaml").is_file()
    assert (target / "dlm_engine" / "strategies" / "low_confidence.py").is_file()
    env = dict(os.environ, PYTHONPATH=str(target))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import sys; sys.argv=['dlm', 'hydra.run.dir=out', 'device=cpu', 'trace.record=false', 'print_outputs=false'];"
            "import dlm_engine; print('PKG', dlm_engine.__file__); from dlm_engine.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(elsewhere), env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (elsewhere / "out" / "summary.json").is_file()
    assert f"PKG {target}" in proc.stdout  # the installed copy ran, not the source tree
