"""lm-evaluation-harness adapter: ``--model dlm_engine`` on a tiny local generate_until task (a JSONL file
in the test's folder, no dataset download): in-process, through lm-eval's own ``lm_eval`` command (found via
the installed start-up hook) and through ``python -m dlm_engine.integrations.lm_eval``."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXACT_MATCH_TASK, need, write_lm_eval_task

lm_eval = need("lm_eval", "eval")  # the only test module that needs lm-eval (plus one test each in two others)

ARGS = "model=tiny_random,strategy=threshold,strategy.block_length=8,gen_length=8,device=cpu,trace.record=false"
DOCS = [{"prompt": "347+085=", "answer": "0432"}, {"prompt": "901-256=", "answer": "645"},
        {"prompt": "name a fruit:", "answer": "plum"}]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return write_lm_eval_task(tmp_path_factory.mktemp("lm_eval_task"), "dlm_tiny", DOCS, EXACT_MATCH_TASK)


def _env():
    return dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE")


# the d2Cache family through the adapter too (issue 14): each with the generations dlm_engine makes directly
NEW = "model=tiny_random,gen_length=8,device=cpu,trace.record=false,strategy="


@pytest.mark.slow
@pytest.mark.parametrize("args", [ARGS] + [NEW + s for s in ("d2c", "pc_sampler", "eb_sampler", "certainty_prior",
                                                               "klass", "ar", "wino")],
                         ids=lambda a: a.split("strategy=")[1].split(",")[0])
def test_simple_evaluate_runs_generate_until_with_our_generations(task_dir, monkeypatch, args):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import dlm_engine.integrations.lm_eval as adapter

    res = simple_evaluate(model="dlm_engine", model_args=args, tasks=["dlm_tiny"],
                          task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    metrics = res["results"]["dlm_tiny"]
    samples = res["samples"]["dlm_tiny"]
    assert metrics["exact_match,none"] == sum(s["exact_match"] for s in samples) / len(samples)
    assert len(samples) == len(DOCS)
    # the harness received exactly what dlm_engine decodes for these prompts with this config
    lm = adapter.DLMEngineLM(**dict(kv.split("=") for kv in args.split(",")))
    import torch

    from dlm_engine.app.api import run_prompts

    torch.manual_seed(0)
    ids = [lm.lm.encode(d["prompt"]) for d in DOCS]
    stats = run_prompts(lm.lm, ids, lm.make_strategy, lm.make_cache, 8, 8, warmup=False)
    direct = {d["prompt"]: adapter.cut(r.text, ["\n"], 8, lm.lm) for d, r in zip(DOCS, stats.rows)}
    for s in samples:
        assert s["resps"][0][0] == direct[s["doc"]["prompt"]]


def _samples(out):
    files = list(out.rglob("samples_*.jsonl"))
    assert files, f"no samples under {out}"
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_lm_eval_own_command_knows_the_model_name(task_dir, tmp_path):
    """Plain ``lm_eval --model dlm_engine`` (the installed .pth hook registers the name). No --device: lm-eval
    then passes cuda:0, which must not stop a CPU-only machine. The embedded model solves add/sub."""
    out = tmp_path / "out"
    proc = subprocess.run([str(Path(sys.executable).parent / "lm_eval"), "--model", "dlm_engine",
                           "--model_args", "strategy=threshold,trace.record=false", "--tasks", "dlm_tiny",
                           "--include_path", str(task_dir), "--limit", "2", "--log_samples",
                           "--output_path", str(out)], capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dlm_tiny" in proc.stdout and "exact_match" in proc.stdout
    got = {s["doc"]["prompt"]: s["resps"][0][0] for s in _samples(out)}
    assert got == {"347+085=": "0432", "901-256=": "645"}


@pytest.mark.slow
def test_start_up_hook_is_lazy_and_can_be_turned_off(tmp_path):
    """After start-up nothing of dlm_engine or torch is loaded; importing lm-eval's registry adds a lazy
    entry next to lm-eval's own models; DLM_ENGINE_LM_EVAL_HOOK=0 leaves lm-eval untouched."""
    code = ("import sys; assert 'dlm_engine' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules);"
            "from lm_eval.api.registry import model_registry as r;"
            "print('ENTRY', r._objs.get('dlm_engine'), 'hf' in r, 'dlm_engine' in sys.modules)")
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                        env=_env())
    assert on.returncode == 0, on.stderr[-2000:]
    assert "ENTRY dlm_engine.integrations.lm_eval:DLMEngineLM True False" in on.stdout
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                         env=dict(_env(), DLM_ENGINE_LM_EVAL_HOOK="0"))
    assert off.returncode == 0, off.stderr[-2000:]
    assert "ENTRY None" in off.stdout


def test_hook_registers_into_an_already_loaded_registry_and_upgrades_to_the_class():
    import lm_eval.api.registry as registry

    from dlm_engine.integrations import lm_eval_hook

    saved = dict(registry.model_registry._objs)
    try:
        for alias in lm_eval_hook.ALIASES:
            registry.model_registry._objs.pop(alias, None)
        lm_eval_hook.install()  # lm-eval is loaded already: registers at once, as a lazy placeholder
        assert registry.model_registry._objs["dlm-engine"] == lm_eval_hook.ENTRY
        from dlm_engine.integrations.lm_eval import DLMEngineLM

        assert registry.get_model("dlm-engine") is DLMEngineLM
    finally:
        registry.model_registry._objs.clear()
        registry.model_registry._objs.update(saved)


@pytest.mark.slow
def test_wrapper_command_knows_the_model_name(task_dir, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dlm_engine.integrations.lm_eval", "--model", "dlm_engine", "--model_args", ARGS,
                           "--tasks", "dlm_tiny", "--include_path", str(task_dir), "--limit", "2",
                           "--output_path", str(out)], capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dlm_tiny" in proc.stdout and "exact_match" in proc.stdout
    assert list(out.rglob("results*.json"))


def test_rolling_loglikelihood_is_refused_with_a_clear_message():
    import dlm_engine.integrations.lm_eval as adapter

    lm = adapter.DLMEngineLM(**dict(kv.split("=") for kv in ARGS.split(",")))
    with pytest.raises(NotImplementedError, match="rolling"):
        lm.loglikelihood_rolling([])


def test_bad_model_args_fail_like_dlm():
    import dlm_engine.integrations.lm_eval as adapter
    from dlm_engine.errors import ConfigError

    with pytest.raises(ConfigError, match="strategy.threshold"):
        adapter.DLMEngineLM(**{"model": "tiny_random", "strategy": "threshold", "strategy.threshold": 1.5})


@pytest.mark.slow
def test_a_model_args_typo_on_lm_evals_command_line_is_one_line(task_dir, monkeypatch, capsys):
    """On lm-eval's command line (argv[0] lm_eval) a bad --model_args value is one line and exit 2, through
    lm-eval's own simple_evaluate; called as a library, the ConfigError propagates."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from dlm_engine.errors import ConfigError

    args = dict(model="dlm_engine", model_args="model=tiny_random,strategy=treshold", tasks=["dlm_tiny"],
                task_manager=TaskManager(include_path=str(task_dir)))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConfigError, match="did you mean strategy=threshold"):
        simple_evaluate(**args)
    monkeypatch.setattr(sys, "argv", [str(Path(sys.executable).parent / "lm_eval"), "--model", "dlm_engine"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        simple_evaluate(**args)
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1:] == [
        "dlm_engine: error: strategy=treshold: no such strategy (choose from ar, block_buffer, cadllm, certainty_prior, "
        "d2c, dmax, dream, early_exit, eb_sampler, edit, edit_quality, edit_speed, factor, fdv2, fdv2_batch, klass, "
        "llada2, low_confidence, "
        "pc_sampler, sdar, threshold, wino); "
        "did you mean strategy=threshold?"]


def test_generate_until_reports_per_sequence_metrics(capsys):
    import dlm_engine.integrations.lm_eval as adapter

    class Req:
        def __init__(self, ctx):
            self.args = (ctx, {"until": ["\n"]})

    lm = adapter.DLMEngineLM(**dict(kv.split("=") for kv in ARGS.split(",")), batch_size=2)
    lm.generate_until([Req(d["prompt"]) for d in DOCS])
    m = lm.metrics
    assert m.sequences == 3 and m.nfe == sum(r.nfe for r in lm.rows)
    assert m.tpf == pytest.approx(sum(r.generated_tokens for r in lm.rows) / m.nfe)
    assert m.model_calls <= m.nfe  # two batches: fewer batched calls than per-sequence forwards
    line = [l for l in capsys.readouterr().err.splitlines() if l.startswith("dlm_engine: generate_until:")]
    assert len(line) == 1 and "NFE/seq" in line[0] and "TPF" in line[0] and "model calls" in line[0]


def test_cut_at_stop_strings():
    from dlm_engine.integrations.lm_eval import cut

    assert cut("12\n34", ["\n"]) == "12"
    assert cut("abcXYZdef", ["Z", "c"]) == "ab"
    assert cut("abc", "b") == "a" and cut("abc", None) == "abc"


def test_generation_kwargs_the_strategy_owns_are_reported_once(caplog):
    import logging

    import dlm_engine.integrations.lm_eval as adapter

    class Req:
        def __init__(self, ctx, kw):
            self.args = (ctx, kw)

    lm = adapter.DLMEngineLM(**dict(kv.split("=") for kv in ARGS.split(",")))
    reqs = [Req("347+085=", {"until": ["\n"], "temperature": 0.7, "do_sample": True}), Req("901-256=", {"until": ["\n"]})]
    with caplog.at_level(logging.WARNING, logger="dlm_engine.integrations.lm_eval"):
        lm.generate_until(reqs)
        lm.generate_until(reqs)
    warned = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    assert len(warned) == 1 and "do_sample, temperature" in warned[0] and "strategy.temperature" in warned[0]


def test_generate_until_decodes_with_the_thread_count_of_model_args(thread_counts):
    import torch

    import dlm_engine.integrations.lm_eval as adapter

    class Req:
        def __init__(self, ctx):
            self.args = (ctx, {"until": ["\n"]})

    lm = adapter.DLMEngineLM(**dict(kv.split("=") for kv in ARGS.split(",")), threads="1")
    before = torch.get_num_threads()
    lm.generate_until([Req(DOCS[0]["prompt"])])
    assert thread_counts == [1, before] and lm.cfg.threads == 1


def test_sampling_kwargs_that_ask_for_what_the_strategy_does_are_not_warned_about(caplog):
    """Issue 47 item 17: a task's `do_sample: false` (or temperature 0) with a greedy strategy is applied, in
    effect: no warning; `do_sample: true` with that strategy still is one."""
    import logging

    import dlm_engine.integrations.lm_eval as adapter

    class Req:
        def __init__(self, ctx, kw):
            self.args = (ctx, kw)

    lm = adapter.DLMEngineLM(**dict(kv.split("=") for kv in ARGS.split(",")))
    assert not lm.cfg.strategy.get("temperature")
    with caplog.at_level(logging.WARNING, logger="dlm_engine.integrations.lm_eval"):
        lm.generate_until([Req("347+085=", {"until": ["\n"], "do_sample": False, "temperature": 0.0})])
    assert not [r for r in caplog.records if "not applied" in r.getMessage()]
    assert adapter.sampling_agrees("do_sample", True, 0.7) and not adapter.sampling_agrees("do_sample", True, 0.0)
    assert adapter.sampling_agrees("temperature", 0.7, 0.7) and not adapter.sampling_agrees("top_p", 0.9, 0.0)
