"""Configs ship inside the package: a non-editable install finds them from any working directory."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, need

pytestmark = pytest.mark.slow     # starts processes (see pyproject.toml's markers)


def test_non_editable_install_finds_configs(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True, timeout=600)
    assert (target / "dlm_engine" / "conf" / "config.yaml").is_file()
    assert (target / "dlm_engine" / "strategies" / "low_confidence.py").is_file()
    assert (target / "dlm_engine" / "conf" / "serve.yaml").is_file()          # dlm-serve's config and live page
    assert (target / "dlm_engine" / "serve" / "page.html").is_file()
    assert (target / "dlm_engine" / "checkpoints" / "tiny_bd" / "model.safetensors").is_file()   # both embedded models
    env = dict(os.environ, PYTHONPATH=str(target))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import sys; sys.argv=['dlm', 'hydra.run.dir=out', 'device=cpu', 'trace.record=false', 'print_outputs=false'];"
            "import dlm_engine; print('PKG', dlm_engine.__file__); from dlm_engine.app.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(elsewhere), env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (elsewhere / "out" / "summary.json").is_file()
    assert f"PKG {target}" in proc.stdout  # the installed copy ran, not the source tree


def test_non_editable_install_ships_the_lm_eval_start_up_hook(tmp_path):
    """The wheel puts ``dlm_engine_lm_eval.pth`` and its module at the root of site-packages; processing that
    site directory makes ``--model dlm_engine`` resolve to the installed copy of the adapter."""
    need("lm_eval", "eval")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True, timeout=600)
    pth = target / "dlm_engine_lm_eval.pth"
    assert pth.read_text().strip() == "import dlm_engine_lm_eval_hook; dlm_engine_lm_eval_hook.install()"
    assert (target / "dlm_engine_lm_eval_hook.py").read_text() == (ROOT / "dlm_engine" / "integrations" / "lm_eval_hook.py").read_text()
    # this interpreter's own environment may carry the hook too: drop it, then process only the target's .pth
    code = ("import sys, site;"
            "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, 'dlm_engine_lm_eval_hook', False)];"
            "sys.modules.pop('dlm_engine_lm_eval_hook', None);"
            f"site.addsitedir({str(target)!r});"
            "import dlm_engine_lm_eval_hook as h; print('HOOK', h.__file__);"
            "from lm_eval.api.registry import get_model; cls = get_model('dlm_engine');"
            "print('CLS', cls.__name__, sys.modules[cls.__module__].__file__)")
    env = dict(os.environ, PYTHONPATH=str(target))
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"HOOK {target}" in proc.stdout
    assert f"CLS DLMEngineLM {target}" in proc.stdout
