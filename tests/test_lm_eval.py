"""lm-evaluation-harness adapter: ``--model dlm_engine`` on a tiny local generate_until task (a JSONL file
in the test's folder, no dataset download), in-process and through ``python -m dlm_engine.lm_eval``."""
import json
import os
import subprocess
import sys

import pytest

import lm_eval  # noqa: E402,F401  (the 'eval' extra; the 'dev' extra installs it too)


ARGS = "model=tiny_random,strategy=threshold,strategy.block_length=8,gen_length=8,device=cpu,trace.record=false"
DOCS = [{"prompt": "347+085=", "answer": "0432"}, {"prompt": "901-256=", "answer": "645"},
        {"prompt": "name a fruit:", "answer": "plum"}]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_task")
    (d / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in DOCS))
    (d / "dlm_tiny.yaml").write_text(f"""task: dlm_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'docs.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return d


def _env():
    return dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE")


def test_simple_evaluate_runs_generate_until_with_our_generations(task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import dlm_engine.lm_eval as adapter
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model="dlm_engine", model_args=ARGS, tasks=["dlm_tiny"],
                          task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    metrics = res["results"]["dlm_tiny"]
    assert "exact_match,none" in metrics and 0.0 <= metrics["exact_match,none"] <= 1.0
    samples = res["samples"]["dlm_tiny"]
    assert len(samples) == len(DOCS)
    # the harness received exactly what dlm_engine decodes for these prompts with this config
    lm = adapter.DLMEngineLM(**dict(kv.split("=") for kv in ARGS.split(",")))
    from dlm_engine.generate import run_prompts
    import torch

    torch.manual_seed(0)
    ids = [lm.lm.encode(d["prompt"]) for d in DOCS]
    stats = run_prompts(lm.lm, ids, lm.make_strategy, lm.make_cache, 8, 8, warmup=False)
    direct = {d["prompt"]: adapter.cut(r.text, ["\n"], 8, lm.lm) for d, r in zip(DOCS, stats.rows)}
    for s in samples:
        assert s["resps"][0][0] == direct[s["doc"]["prompt"]]


def test_wrapper_command_knows_the_model_name(task_dir, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dlm_engine.lm_eval", "--model", "dlm_engine", "--model_args", ARGS,
                           "--tasks", "dlm_tiny", "--include_path", str(task_dir), "--limit", "2",
                           "--output_path", str(out)], capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dlm_tiny" in proc.stdout and "exact_match" in proc.stdout
    assert list(out.rglob("results*.json"))


def test_loglikelihood_is_refused_with_a_clear_message():
    import dlm_engine.lm_eval as adapter

    lm = adapter.DLMEngineLM(**dict(kv.split("=") for kv in ARGS.split(",")))
    with pytest.raises(NotImplementedError, match="generate_until"):
        lm.loglikelihood([])


def test_bad_model_args_fail_like_dlm():
    import dlm_engine.lm_eval as adapter
    from dlm_engine.errors import ConfigError

    with pytest.raises(ConfigError, match="strategy.threshold"):
        adapter.DLMEngineLM(**{"model": "tiny_random", "strategy": "threshold", "strategy.threshold": 1.5})


def test_cut_at_stop_strings():
    from dlm_engine.lm_eval import cut

    assert cut("12\n34", ["\n"]) == "12"
    assert cut("abcXYZdef", ["Z", "c"]) == "ab"
    assert cut("abc", "b") == "a" and cut("abc", None) == "abc"
