"""The embedded tiny model: ships in the package, loads offline, keeps its accuracy; training runs end to end."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run_dlm
from dlm_engine.app import tasks
from dlm_engine.checkpoints import embedded_path


def test_embedded_checkpoint_is_small_and_documented():
    path = embedded_path("tiny")
    assert path is not None, "dlm_engine/checkpoints/tiny is missing"
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size <= 10 * 1024 * 1024
    card = open(os.path.join(path, "README.md")).read()
    assert "accuracy" in card.lower() and "train_tiny.py" in card


def test_embedded_model_accuracy_regression_guard():
    from dlm_engine.app.api import load_directory, run_prompts
    from dlm_engine.core.registry import cache_class, strategy_class

    lm = load_directory(embedded_path("tiny"))
    examples = tasks.held_out(64)
    cls, none = strategy_class("low_confidence"), cache_class("none")
    stats = run_prompts(lm, [lm.encode(e.prompt) for e in examples], lambda: cls(cls.Config(steps=16), 16),
                        lambda: none(none.Config()), gen_length=16, batch_size=64)
    acc = sum(tasks.check(e.task, e.prompt, r.text) for e, r in zip(examples, stats.rows)) / len(examples)
    assert acc >= 0.85, acc


def test_checkers_accept_any_valid_answer_and_reject_wrong_ones():
    assert tasks.check("add", "347+085=", "0432") and not tasks.check("add", "347+085=", "432")
    assert tasks.check("sub", "901-256=", "645") and not tasks.check("sub", "901-256=", "646")
    assert tasks.check("pick", "name a fruit:", "kiwi") and not tasks.check("pick", "name a fruit:", "kiwo")
    assert tasks.check("split", "sum 13:", "4+9") and tasks.check("split", "sum 13:", "9+4")
    assert not tasks.check("split", "sum 13:", "4+8") and not tasks.check("split", "sum 13:", "13+0")
    ex = tasks.held_out(40)
    assert ex == tasks.held_out(40) and {e.task for e in ex} == set(tasks.GENERATORS)
    assert all(tasks.check(e.task, e.prompt, e.answer) for e in ex)


@pytest.mark.slow
def test_training_script_runs_end_to_end(tmp_path):
    out = tmp_path / "ck"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "train_tiny.py"), "--out", str(out),
                           "--steps", "3", "--d-model", "32", "--layers", "1", "--heads", "2", "--mlp", "64",
                           "--batch", "8", "--log-every", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    log = json.loads((out / "training.json").read_text())["log"]
    assert len(log) == 3 and all(torch.isfinite(torch.tensor(l["loss"])) for l in log)
    res = run_dlm([f"hydra.run.dir={tmp_path / 'run'}", "model=local", f"model.path={out}", "task=tiny_mix",
                   "task.n=4", "trace.record=false"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert summary["prompts"] == 4 and len(rows) == 4                  # the checker ran on every row
    assert summary["accuracy"] == sum(r["correct"] for r in rows) / 4


@pytest.mark.slow
def test_default_dlm_run_reports_accuracy(tmp_path):
    res = run_dlm([f"hydra.run.dir={tmp_path / 'run'}", "trace.record=false"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == "tiny" and summary["prompts"] == 50
    assert summary["accuracy"] >= 0.8
    assert "accuracy" in res.stdout and "TPF" in res.stdout


def test_load_directory_defaults_to_the_embedded_model_and_names_a_missing_one():
    import pytest

    from dlm_engine.errors import UserError
    from dlm_engine.app.api import load_directory

    lm = load_directory()
    assert lm.name == "tiny" and lm.encode("1+1=") and not lm.chat_template
    with pytest.raises(UserError, match="embedded 'nope'"):
        load_directory(name="nope")
