import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
REFPARITY = FIXTURES / "refparity"
BIN = Path(sys.executable).parent

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests are skipped where no CUDA device is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs where one is lent)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# programs a quick test may start: the trace header's `git rev-parse` / `git status` (milliseconds)
QUICK_PROGRAMS = {"git"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Keeps the quick tier quick: a test not marked ``slow`` that starts a process (a CLI, ``parity.py``, a
    Python interpreter; in the test or in a fixture it sets up) fails with a line that says to mark it."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    real = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = Path(os.fsdecode(argv[0])).name if argv else ""
        if program not in QUICK_PROGRAMS:
            pytest.fail(f"{item.nodeid} starts a process ({program}): mark it @pytest.mark.slow", pytrace=False)
        real(self, args, *a, **kw)

    subprocess.Popen.__init__ = guarded
    try:
        yield
    finally:
        subprocess.Popen.__init__ = real


def need(module: str, extra: str):
    """Import an optional dependency or skip, naming the extra that installs it. With
    ``DLM_ENGINE_TEST_ALL=1`` (CI: `.ci/run`) a missing one fails instead, so CI cannot skip it silently."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get("DLM_ENGINE_TEST_ALL") == "1":
            raise
        pytest.skip(f"{module} is not installed: pip install -e '.[{extra}]' (the 'dev' extra has it)",
                    allow_module_level=True)


def run_dlm(args, cwd, env=None, timeout=300, exe="dlm"):
    """Run a console script of this environment as a subprocess; returns CompletedProcess."""
    e = dict(os.environ)
    e.update(env or {})
    e["HYDRA_FULL_ERROR"] = "0"
    return subprocess.run([str(BIN / exe), *args], cwd=str(cwd), env=e, capture_output=True, text=True,
                          timeout=timeout)


def load_experiment(script: str, name: str = None):
    """``experiments/<script>.py`` (a script, not a package module) loaded as module ``name`` (default: the
    script's), with ``experiments/`` on the import path while it loads (the scripts import each other)."""
    import importlib.util

    name = name or script
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod               # dataclasses resolve string annotations through sys.modules
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    return mod


@pytest.fixture(scope="session")
def parity():
    """``experiments/parity.py`` loaded once per session."""
    return load_experiment("parity", "dlm_parity")


def watch_calls(cache, what=lambda c: c):
    """Wrap ``cache.forward``; returns the list that gets ``what(call)`` of every model call once it ran."""
    from contextlib import contextmanager

    calls = []
    inner = cache.forward

    @contextmanager
    def forward(call):
        with inner(call) as c:
            yield c
        calls.append(what(c))

    cache.forward = forward
    return calls


def record_calls(cache):
    """Wrap ``cache.forward`` to record (refresh?, compute span, batch) of every model call."""
    return watch_calls(cache, lambda c: (c.refreshed, tuple(c.compute), c.batch_size))


# cache options a batch needs: dLLM-Cache's reference schedule is one for the batch and stops when rows that sat steps
# out diverge (tests/test_adaptive_caches.py); per-row schedules decode every row as alone
BATCH_CACHE_OPTIONS = {"dllm": {"per_row_schedule": True}}


def batch_cache(name: str):
    """A fresh cache ``name`` with the options a left-padded batch needs (``BATCH_CACHE_OPTIONS``)."""
    from dlm_engine.core.registry import cache_class

    cls = cache_class(name)
    return cls(cls.Config(**BATCH_CACHE_OPTIONS.get(name, {})))


def fuzz_cases(n: int, chunks: int = 4):
    """Decorator: run ``test(seed)`` over seeds ``0..n-1`` as ``chunks`` test cases (fuzzed checks: a case per seed
    would add hundreds of test ids that say nothing more)."""
    def deco(check):
        @pytest.mark.parametrize("chunk", range(chunks))
        def test(chunk):
            for seed in range(chunk * n // chunks, (chunk + 1) * n // chunks):
                check(seed)

        test.__name__, test.__doc__ = check.__name__, check.__doc__
        return test

    return deco


def decode_in_batches(model, prompts, gen, strategy, make_cache, mask_id=1000, pad_id=1001):
    """Decode ``prompts`` as the API does: in batches of at most ``strategy.max_batch`` rows (all at once when the
    strategy has no cap), a fresh cache each; returns the canvases."""
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode

    n = strategy.max_batch or len(prompts)
    out = []
    for i in range(0, len(prompts), n):
        canvas = Canvas.from_prompts(prompts[i:i + n], gen, mask_id, pad_id)
        decode(model, canvas, strategy, make_cache())
        out.append(canvas)
    return out


def small_strategies(gen: int = 16):
    """``(name, strategy)`` of every registered strategy with small blocks (8) that fit ``gen``."""
    from dlm_engine.core.registry import STRATEGIES, load_plugins

    load_plugins()
    for name, cls in sorted(STRATEGIES.items()):
        kw = {"block_length": 8} if "block_length" in cls.Config.__dataclass_fields__ else {}
        if name == "dream":
            kw["steps"] = 4
        yield name, cls(cls.Config(**kw), gen)


@pytest.fixture
def thread_counts(monkeypatch):
    """Every count passed to ``torch.set_num_threads`` during the test, in order (each call still takes effect)."""
    import torch

    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda k: (calls.append(k), real(k)))
    return calls


@pytest.fixture(scope="session")
def tiny_llada():
    from dlm_engine.models.loader import load_pretrained

    model, raw, digest = load_pretrained(REFPARITY / "tiny_llada", device="cpu", dtype="float32")
    return model


@pytest.fixture(scope="session")
def parity_candidates(tmp_path_factory):
    """Run `experiments/parity.py` on the refparity copy once per session; {case id: candidate}."""
    import json

    out, stdout = run_parity(REFPARITY, tmp_path_factory.mktemp("parity"))
    data = json.loads(out.read_text())
    return {c["id"]: c for c in data["cases"]}, stdout


def run_parity(folder, tmp):
    """``experiments/parity.py FOLDER`` in a subprocess; returns (candidate file, its stdout)."""
    out = Path(tmp) / "candidate.json"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "parity.py"), str(folder), str(out)],
                          capture_output=True, text=True, timeout=1200, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def compare_with_reference(candidates, ids, tmp_path):
    """Run the fixtures' compare.py on the given ids; returns (exit code, output)."""
    import json

    missing = [i for i in ids if i not in candidates]
    assert not missing, f"cases not run by parity.py: {missing}"
    # parity.py records a case that raised as its ``error`` and goes on; compare.py counts those as skipped
    failed = {i: candidates[i]["error"] for i in ids if "error" in candidates[i]}
    assert not failed, f"cases that raised in parity.py: {failed}"
    path = tmp_path / "subset.json"
    path.write_text(json.dumps({"cases": [candidates[i] for i in ids]}))
    proc = subprocess.run([sys.executable, str(FIXTURES / "compare.py"), str(REFPARITY), str(path)],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def fixture_ids(suite, predicate=lambda case: True):
    import json

    data = json.loads((REFPARITY / f"{suite}.json").read_text())
    return [c["id"] for c in data["cases"] if "error" not in c and predicate(c)]


# a generation task over {"prompt", "answer"} docs, scored by exact match (8 tokens, up to a newline)
EXACT_MATCH_TASK = """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_lm_eval_task(directory, name, docs, spec: str):
    """A local lm-eval task (no dataset download): ``docs`` as a JSONL file plus ``NAME.yaml`` with the
    dataset lines and ``spec`` (output type, prompts, metrics); returns ``directory``."""
    import json

    d = Path(directory)
    (d / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    header = (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'docs.jsonl'}\n"
              "test_split: test\n")
    (d / f"{name}.yaml").write_text(header + spec)
    return d


@pytest.fixture(scope="session")
def d2c_candidates(tmp_path_factory):
    """`experiments/parity.py` on the d2cparity copy once per session; ({case id: candidate}, stdout)."""
    import json

    out, stdout = run_parity(FIXTURES / "d2cparity", tmp_path_factory.mktemp("d2cparity"))
    data = json.loads(out.read_text())
    return {c["id"]: c for c in data["cases"]}, stdout


@pytest.fixture(scope="session")
def tiny_dream_model():
    from dlm_engine.models.loader import load_pretrained

    return load_pretrained(FIXTURES / "dreamparity" / "tiny_dream", device="cpu", dtype="float32")[0]
