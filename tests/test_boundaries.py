"""Layer boundaries: the decoding core imports no concrete strategy, cache, model family, application code or
experiment; model code knows no cache; strategies and caches never name each other."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path):
    """Absolute names of every module a file imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod
            for a in node.names:
                yield f"{mod}.{a.name}"


def _violations(files, forbidden):
    bad = []
    for f in files:
        for mod in imported_modules(f):
            if any(mod == p or mod.startswith(p + ".") for p in forbidden):
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    return bad


def test_core_imports_nothing_concrete():
    files = sorted((ROOT / "dlm_engine" / "core").glob("*.py"))
    assert files
    forbidden = ["dlm_engine.strategies", "dlm_engine.cache", "dlm_engine.models", "dlm_engine.app",
                 "dlm_engine.trace", "dlm_engine.sweeps", "dlm_engine.integrations", "strategies", "cache",
                 "experiments"]
    assert _violations(files, forbidden) == []


def test_models_know_no_cache():
    files = sorted((ROOT / "dlm_engine" / "models").glob("*.py"))
    assert _violations(files, ["dlm_engine.cache", "dlm_engine.core.kvcache", "cache", "dlm_engine.strategies"]) == []


@pytest.mark.parametrize("folder, other", [("strategies", "cache"), ("cache", "strategies")])
def test_strategies_and_caches_never_name_each_other(folder, other):
    from dlm_engine.core.registry import CACHES, STRATEGIES, load_plugins

    load_plugins()
    files = sorted((ROOT / folder).glob("*.py"))
    assert _violations(files, [f"dlm_engine.{other}", other]) == []
    names = CACHES.names() if other == "cache" else STRATEGIES.names()
    for f in files:
        text = f.read_text()
        for n in names:
            assert not re.search(rf"['\"]{re.escape(n)}['\"]", text) or n in (f.stem,), \
                f"{f.name} names the {other} registry key '{n}'"


def test_the_check_sees_a_forbidden_import(tmp_path):
    """The boundary check itself fails on a core module that imports a strategy."""
    fake = ROOT / "dlm_engine" / "core" / "_boundary_probe.py"
    fake.write_text("from dlm_engine.strategies import threshold  # noqa\n")
    try:
        assert _violations([fake], ["dlm_engine.strategies"])
    finally:
        fake.unlink()


@pytest.mark.slow
def test_importing_the_core_loads_no_strategy_or_model():
    code = ("import sys, dlm_engine.core.loop, dlm_engine.core.kvcache, dlm_engine.core.strategy;"
            "bad=[m for m in sys.modules if m.startswith(('dlm_engine.strategies','dlm_engine.cache','dlm_engine.models',"
            "'dlm_engine.app.run','dlm_engine.trace'))]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
