"""The `dlm` Hydra app driven as a subprocess: outputs, overrides and one-line user errors."""
import json
import shutil

import pytest

from conftest import REFPARITY, run_dlm

pytestmark = pytest.mark.slow     # starts processes (see pyproject.toml's markers)


def _run(tmp_path, *args):
    out = tmp_path / "run"
    proc = run_dlm([f"hydra.run.dir={out}", *args], cwd=tmp_path)
    return proc, out


def test_default_run_writes_results_and_summary(tmp_path):
    proc, out = _run(tmp_path, "device=cpu", "trace.record=false")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) >= 3
    for r in rows:
        assert {"prompt", "text", "tokens", "nfe"} <= set(r)
        assert len(r["tokens"]) == 16
    summary = json.loads((out / "summary.json").read_text())
    for key in ("nfe", "tpf", "tps", "model_calls", "latency_mean", "generated_tokens", "strategy", "model"):
        assert key in summary
    assert summary["strategy"]["name"] == "low_confidence"
    assert "TPF" in proc.stdout and "TPS" in proc.stdout
    assert rows[0]["prompt"] in proc.stdout
    # a single run ends with its output directory; the job's log holds what the terminal showed
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == f"outputs: {out.resolve()}" and lines[-2].startswith("accuracy ")
    log = (out / "cli.log").read_text()
    assert lines[-2] in log and f"outputs: {out.resolve()}" in log and "decoded 50/50 prompts" in log


def test_prompts_file_batch_and_strategy_options(tmp_path):
    pf = tmp_path / "prompts.txt"
    pf.write_text("12+34=\nname a color:\nsum 3:\n")
    proc, out = _run(tmp_path, f"prompts_file={pf}", "batch_size=2", "seed=3", "device=cpu", "dtype=float32",
                     "gen_length=16", "strategy.block_length=4", "strategy.steps=8", "trace.record=false")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["12+34=", "name a color:", "sum 3:"]
    assert all(r["nfe"] == 8 for r in rows)
    s = json.loads((out / "summary.json").read_text())
    # NFE sums per-sequence forwards (3 x 8); model calls count the batched forwards (2 batches x 8 steps)
    assert s["strategy"]["block_length"] == 4 and s["batch_size"] == 2 and s["nfe"] == 24 and s["model_calls"] == 16
    assert s["nfe_per_prompt"] == 8 and s["tpf"] == pytest.approx(s["generated_tokens"] / 24)


def test_local_checkpoint_directory(tmp_path):
    from dlm_engine.models.tokenizer import save_char_tokenizer

    ck = tmp_path / "ck"
    shutil.copytree(REFPARITY / "tiny_llada", ck)
    save_char_tokenizer(ck)  # ids of the char tokenizer fit the fixture model's 1024-token vocabulary
    proc, out = _run(tmp_path, "model=local", f"model.path={ck}", "prompts=[abc,hello]", "gen_length=8",
                     "trace.record=false")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["abc", "hello"] and all(len(r["tokens"]) == 8 for r in rows)
    assert json.loads((out / "summary.json").read_text())["model_digest"].startswith("sha256:")


@pytest.mark.parametrize("args, needle", [
    (["strategy=nope"], "strategy=nope: no such strategy"),
    (["strategy.steps=abc"], "strategy.steps"),
    (["strategy.bogus=1"], "bogus"),
    (["gen_length=10", "strategy.block_length=4"], "gen_length=10 is not divisible by strategy.block_length=4"),
    (["gen_length=16", "strategy.block_length=8", "strategy.steps=3"], "strategy.steps=3 is not divisible"),
    (["model=local", "model.path=/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["batch_size=0"], "batch_size=0"),
    (["strategy.remasking=sometimes"], "strategy.remasking"),
])
def test_user_errors_are_one_line(tmp_path, args, needle):
    proc, out = _run(tmp_path, *args)
    assert proc.returncode != 0
    assert needle in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    assert not (out / "summary.json").exists()


def test_malformed_checkpoint_is_reported_before_loading(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(REFPARITY / "tiny_llada", ck)
    (ck / "config.json").write_text("{broken")
    proc, out = _run(tmp_path, "model=local", f"model.path={ck}")
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and str(ck) in lines[0] and "not valid JSON" in lines[0]
    assert not out.exists() or not (out / "summary.json").exists()


@pytest.mark.parametrize("args, line", [
    (["strategy=treshold"], "strategy=treshold: no such strategy (choose from ar, block_buffer, cadllm, certainty_prior, d2c, "
                            "dmax, dream, early_exit, eb_sampler, edit, edit_quality, edit_speed, factor, fdv2, fdv2_batch, "
                            "klass, llada2, "
                            "low_confidence, pc_sampler, sdar, threshold, wino); "
                            "did you mean strategy=threshold?"),
    (["strategy=threshold", "strategy.treshold=0.5"], "strategy.treshold: unknown key; did you mean strategy.threshold?"),
    (["gen_lenght=8"], "gen_lenght: unknown key; did you mean gen_length?"),
    (["gen_length=abc"], "gen_length: Value 'abc' of type 'str' could not be converted to Integer"),
    (["cache=dul"], "cache=dul: no such cache (choose from block_kv, block_store, d2cache, dllm, dual, none, prefix); did you mean cache=dual?"),
])
def test_hydra_config_errors_are_one_line_with_a_suggestion(tmp_path, args, line):
    proc, out = _run(tmp_path, *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"dlm: error: {line}"]
    assert not out.exists()


def test_help_into_a_closed_pipe_is_quiet(tmp_path):
    import subprocess

    from conftest import BIN

    proc = subprocess.run(f"{BIN / 'dlm'} --help | head -1", shell=True, capture_output=True, text=True,
                          cwd=str(tmp_path), timeout=120)
    assert proc.stdout.strip() and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
