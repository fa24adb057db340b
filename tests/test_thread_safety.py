"""Process-wide state that threads share is made or changed by one thread at a time.

Library users decode from several threads (a server answering requests, each decode with its own trace recorder).
Three once-per-process initialisations set their "done" flag before doing the work, so a second thread could act
on half-done state, and Hydra's composition clears a process-wide singleton. Each scenario runs in a child process
(a fresh interpreter: nothing initialised yet) and is made deterministic by slowing one step of the work (a
plug-in's import, a ConfigStore store, Hydra's initialise, the text decoder's load), which signals when the first
thread is inside it, so the second thread arrives exactly then. One more test has two threads decode and record at
once, end to end. (The zstd contexts' check is in ``test_trace_codecs.py``.)"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SLOW_PLUGIN = '''
"""A plug-in that takes its time to import: it says when it has started, then registers a strategy."""
import time

import gate
gate.started.set()
time.sleep(0.5)

from dataclasses import dataclass

from dlm_engine.core.registry import register_strategy
from dlm_engine.core.strategy import Strategy


@dataclass
class SlowConfig:
    name: str = "slow_plugin_strategy"


@register_strategy("slow_plugin_strategy", SlowConfig)
class Slow(Strategy):
    pass
'''

GATE = "import threading\nstarted = threading.Event()\n"


def _child(tmp_path, code: str, env=None):
    (tmp_path / "plug").mkdir(exist_ok=True)
    (tmp_path / "plug" / "gate.py").write_text(GATE)
    (tmp_path / "plug" / "slow_plugin.py").write_text(SLOW_PLUGIN)
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "plug"), ROOT]),
                    OMP_WAIT_POLICY="PASSIVE", **(env or {}))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=full_env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_thread_that_looks_up_a_plugin_while_another_imports_the_plugins_waits_for_them(tmp_path):
    """``load_plugins`` set its flag before importing: a second thread returned at once and looked up an empty
    or half-filled registry (``unknown strategy``)."""
    got = _child(tmp_path, """
        import json, threading
        import gate
        from dlm_engine.core.registry import load_plugins, strategy_class
        first = threading.Thread(target=load_plugins)
        first.start()
        gate.started.wait(60)             # the first thread is inside the plug-in imports
        try:
            result = strategy_class("slow_plugin_strategy").name
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"
        first.join()
        print(json.dumps({"result": result}))
    """, env={"DLM_ENGINE_PLUGINS": "slow_plugin"})
    assert got["result"] == "slow_plugin_strategy"


@pytest.mark.slow
def test_a_plugin_that_fails_to_import_fails_every_lookup_not_only_the_first(tmp_path):
    """With the flag set after the work, a failed import leaves the plug-ins unloaded: every call says why,
    instead of the first one alone and silence (an incomplete registry) after it."""
    got = _child(tmp_path, """
        import json
        from dlm_engine.core.registry import load_plugins
        seen = []
        for _ in range(2):
            try:
                load_plugins()
                seen.append("ok")
            except Exception as exc:
                seen.append(str(exc))
        print(json.dumps(seen))
    """, env={"DLM_ENGINE_PLUGINS": "no_such_plugin_module"})
    assert len(got) == 2 and all("DLM_ENGINE_PLUGINS: cannot import 'no_such_plugin_module'" in s for s in got)


@pytest.mark.slow
def test_two_threads_compose_run_configs_at_once(tmp_path):
    """``compose`` clears and re-initialises Hydra's process-wide GlobalHydra: a second thread composing while the
    first was inside failed with "GlobalHydra is already initialized". The first composition is held inside Hydra
    (its config search path is read slowly) while the second starts."""
    got = _child(tmp_path, """
        import json, threading, time
        from hydra.core.global_hydra import GlobalHydra
        from dlm_engine.app.compose import compose
        compose([])                                     # plug-ins and schemas in place: only Hydra's state is left
        inside = threading.Event()
        orig = GlobalHydra.initialize

        def slow_initialize(self, *a, **kw):
            out = orig(self, *a, **kw)
            if threading.current_thread().name == "first":
                inside.set()
                time.sleep(0.5)
            return out

        GlobalHydra.initialize = slow_initialize
        results = {}

        def run(name, overrides):
            try:
                results[name] = compose(overrides).strategy.name
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"

        first = threading.Thread(target=run, args=("first", ["strategy=threshold"]), name="first")
        first.start()
        inside.wait(60)
        run("second", ["strategy=factor"])
        first.join()
        print(json.dumps(results))
    """)
    assert got == {"first": "threshold", "second": "factor"}


@pytest.mark.slow
def test_a_trace_shared_by_threads_gives_every_thread_its_text(tmp_path):
    """``Trace.tokenizer`` set its flag before the decoder existed: a second thread reading text then got token ids
    (no decoder) instead of text. The decoder's loading is held open while the second thread reads."""
    got = _child(tmp_path, f"""
        import json, os, threading, time
        import torch
        from dlm_engine.core.canvas import Canvas, FrameDelta
        from dlm_engine.trace import TraceRecorder, loads
        from dlm_engine.trace import text as text_mod

        path = os.path.join({str(tmp_path)!r}, "t.dlmt")
        c = Canvas.from_prompts([[77, 78]], 4, 3, 0)
        with TraceRecorder(path, {{"model": {{"eos_id": 2, "mask_id": 3}}, "tokenizer": {{"kind": "char"}}}}) as rec:
            s = rec.sink(0, [0])
            s.on_start(c, {{}})
            d = FrameDelta(step=1, nfe=1, start=2, commit=torch.ones(1, 4, dtype=torch.bool),
                           tokens=torch.tensor([[40, 41, 42, 43]]), active=torch.ones(1, dtype=torch.bool),
                           finished=torch.ones(1, dtype=torch.bool))
            c.apply(d)
            s.on_delta(d, c)
            s.on_end(c)
        tr = loads(open(path, "rb").read())
        inside = threading.Event()
        orig = text_mod.text_decoder

        def slow_decoder(*a, **kw):
            inside.set()
            time.sleep(0.5)
            return orig(*a, **kw)

        text_mod.text_decoder = slow_decoder
        out = {{}}
        first = threading.Thread(target=lambda: out.__setitem__("first", tr[0].text))
        first.start()
        inside.wait(60)
        out["second"] = tr[0].text
        first.join()
        print(json.dumps(out))
    """)
    assert got["first"] == got["second"]
    assert not got["second"].startswith("40 ")        # text, not the ids shown when no decoder exists


def test_two_threads_decode_and_record_at_once_and_every_trace_replays_their_tokens(tmp_path):
    """End to end: two threads, each decoding two settings (a batch of 1 and a batch of 3) with its own recorder at
    the same time, the embedded model shared. Greedy decodes: every trace must verify, replay (without the model)
    to its decode's final tokens, and the tokens must equal a one-thread run's."""
    import threading

    import numpy as np
    import torch

    from dlm_engine.app.api import load_model, run_prompts
    from dlm_engine.app.compose import compose
    from dlm_engine.app.run import load_inputs, validate
    from dlm_engine.trace import open_trace
    from dlm_engine.app.recording import open_run_recorder
    from dlm_engine.trace.tools import verify_integrity

    jobs, lm, ids = [], None, None
    for name, over in (("threshold_b1", ["strategy=threshold", "batch_size=1"]),
                       ("d2c_b3", ["strategy=d2c", "batch_size=3"])):
        cfg = compose(over + ["gen_length=16", "device=cpu", "dtype=float32"])
        ms, mc = validate(cfg)
        if lm is None:
            lm = load_model(cfg.model, cfg.device, cfg.dtype)
            ids = load_inputs(cfg, lm)["ids"][:4]
        jobs.append((name, cfg, ms, mc))

    def run(job, out_dir):
        name, cfg, ms, mc = job
        os.makedirs(out_dir, exist_ok=True)
        rec = open_run_recorder(cfg, out_dir, lm, ids)
        with rec:
            st = run_prompts(lm, ids, ms, mc, cfg.gen_length, cfg.batch_size,
                             sinks_for_batch=lambda b, rows: [rec.sink(b, rows)], warmup=False)
        return [r.tokens for r in st.rows], rec.written_path

    with torch.inference_mode():
        reference = {job[0]: run(job, str(tmp_path / "ref" / job[0]))[0] for job in jobs}
    results, errors = [], []
    barrier = threading.Barrier(2)

    def worker(i):
        try:
            barrier.wait()
            for job in jobs[i:] + jobs[:i]:            # the two threads run different settings at the same time
                results.append((job[0], *run(job, str(tmp_path / f"t{i}" / job[0]))))
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 4
    for name, tokens, path in results:
        assert tokens == reference[name], name
        tr = open_trace(path, recover=False)
        verify_integrity(tr)
        assert tr.status == "complete" and [s.row for s in tr] == list(range(len(ids)))
        for s, want in zip(tr, tokens):
            assert s.tokens.tolist() == want
            assert np.array_equal(s.state_at(s.n_steps), np.asarray(want))


@pytest.mark.slow
def test_a_thread_never_composes_before_another_has_stored_the_schemas(tmp_path):
    """``register_configs`` set its flag before storing the schemas: a second thread went on to compose with
    ``run_schema`` not yet in Hydra's ConfigStore. The first thread's stores are held open while the second
    registers and composes."""
    got = _child(tmp_path, """
        import json, threading, time
        from hydra.core.config_store import ConfigStore
        from dlm_engine.core.registry import load_plugins
        load_plugins()                                   # (the plug-ins' schemas: not what this test is about)
        from dlm_engine.app import config as app_config
        from dlm_engine.app.compose import compose
        inside = threading.Event()
        orig = ConfigStore.store

        def slow_store(self, *a, **kw):
            if threading.current_thread().name == "first" and not inside.is_set():
                inside.set()
                time.sleep(0.5)
            return orig(self, *a, **kw)

        ConfigStore.store = slow_store
        first = threading.Thread(target=app_config.register_configs, name="first")
        first.start()
        inside.wait(60)
        try:
            result = compose(["strategy=threshold"]).strategy.name
        except Exception as exc:
            result = f"{type(exc).__name__}: {exc}"
        first.join()
        print(json.dumps({"result": result}))
    """)
    assert got["result"] == "threshold"
