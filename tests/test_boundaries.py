"""Layer boundaries: the decoding core imports no concrete strategy, cache, model family, application code or
experiment; model code knows no cache; strategies and caches never name each other."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path, pkg: str = None):
    """Absolute names of every module a file imports (relative imports resolved against ``pkg``, by default the
    file's folder)."""
    tree = ast.parse(path.read_text())
    if pkg is None:
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


# -- the import graph of the package: no cycles between its layers ----------------------------------------------
ENTRY_POINTS_TABLE = "[project.scripts]"


def module_files():
    """``{module name: file}`` for every module of the installed package (strategies/ and cache/ install as
    ``dlm_engine.strategies`` / ``dlm_engine.cache``)."""
    out = {}
    for f in [*ROOT.glob("dlm_engine/**/*.py"), *ROOT.glob("strategies/*.py"), *ROOT.glob("cache/*.py")]:
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[0] in ("strategies", "cache"):
            parts = ["dlm_engine"] + parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts != ["dlm_engine"]:      # the package root (every import passes through it) is no layer
            out[".".join(parts)] = f
    return out


def import_graph(files=None):
    """``{module: modules of the package it imports}``, every import counted (also those inside functions: a
    lazy import is a dependency all the same), each resolved to the module it names."""
    files = files or module_files()

    def resolve(name):
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, f in files.items():
        pkg = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        out = set()
        for n in imported_modules(f, pkg):
            r = resolve(n) if n.startswith("dlm_engine") else ""
            if r and r not in ("dlm_engine", mod):
                out.add(r)
        graph[mod] = out
    return graph


def entry_points():
    """The command-line entry modules (pyproject's [project.scripts]): the top of the stack, free to reach any
    layer, and imported by none."""
    text = (ROOT / "pyproject.toml").read_text().split(ENTRY_POINTS_TABLE, 1)[1].split("\n[", 1)[0]
    return set(re.findall(r'=\s*"([\w.]+):', text))


def layer(mod: str) -> str:
    """The subpackage a module is in (``app``, ``trace``, ...); a top-level module (``dlm_engine.errors``) is a
    layer of its own."""
    top = mod.split(".")[1]
    return top if top in ("strategies", "cache") or (ROOT / "dlm_engine" / top).is_dir() else f"dlm_engine.{top}"


def cycles(graph):
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer_graph(graph):
    """The graph of layers (subpackages: app, sweeps, trace, models, core, ...), entry points left out."""
    skip = entry_points()
    out = {}
    for mod, targets in graph.items():
        if mod in skip:
            continue
        for t in targets:
            if layer(t) != layer(mod):
                out.setdefault(layer(mod), set()).add(layer(t))
    return out


def edges(graph, a, b):
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if layer(m) == a and layer(t) == b)


def test_the_layers_import_each_other_without_cycles():
    """app, sweeps, trace, models, core, serve, integrations, strategies, cache: each pair at most one way round
    (app <-> sweeps and app <-> trace were cycles); the command-line entry points sit on top."""
    graph = import_graph()
    found = cycles(layer_graph(graph))
    assert found == [], "layer cycles: " + "; ".join(
        f"{c}: " + ", ".join(e for a in c for b in c if a != b for e in edges(graph, a, b)[:3]) for c in found)
    assert {"app", "sweeps", "trace", "models", "core"} <= set(layer_graph(graph)) | {"core"}


def test_no_module_imports_an_entry_point():
    graph = import_graph()
    skip = entry_points()
    assert skip and all(m in graph for m in skip), skip
    assert sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if t in skip and m not in skip) == []


def test_modules_of_different_layers_form_no_cycle_and_models_none_at_all():
    """A module-level cycle that crosses layers, or any among models/ (base -> families -> llada/dream -> base
    was one): none. (A package's __init__ re-exporting its modules is the one cycle left, inside trace/.)"""
    graph = import_graph()
    bad = [c for c in cycles(graph) if len({layer(m) for m in c}) > 1 or any(m.startswith("dlm_engine.models") for m in c)]
    assert bad == []


def test_the_cycle_check_sees_a_cycle():
    """The checks fail on the cycles they are for: a layer cycle (trace imports app, which imports trace) and a
    module cycle inside models."""
    graph = import_graph()
    probe = {k: set(v) for k, v in graph.items()}
    probe["dlm_engine.trace.reader"].add("dlm_engine.app.run")
    assert any({"app", "trace"} <= set(c) for c in cycles(layer_graph(probe)))
    probe = {k: set(v) for k, v in graph.items()}
    probe["dlm_engine.models.base"].add("dlm_engine.models.families")
    assert any("dlm_engine.models.base" in c for c in cycles(probe))
