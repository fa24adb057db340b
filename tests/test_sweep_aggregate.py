"""Sweep pieces that need no full sweep: job directory names, resume decisions, the aggregation table,
Pareto front and plots (from result files written here), the `dlm-sweep` command without matplotlib,
the sweep presets; plus one real sweep with glob() and failing jobs."""
import csv
import json
import subprocess
import sys

import pytest

from conftest import run_dlm
from dlm_engine.sweeps import cli as sweep
from dlm_engine.app import jobs as sweep_jobs
from dlm_engine.sweeps.cli import aggregate
from dlm_engine.metrics import METRICS_VERSION
from dlm_engine.app.jobs import JobRecord, job_dirname


# ------------------------------------------------------------------------------------------- job dirs
def test_job_dirname_is_sorted_safe_and_ignores_neutral_keys():
    a = job_dirname(["strategy=threshold", "+sweep=threshold_grid", "model.path=/a/b c", "strategy.threshold=0.5",
                     "resume=false", "print_outputs=false", "progress=false"])
    b = job_dirname(["strategy.threshold=0.5", "model.path=/a/b c", "strategy=threshold"])
    assert a == b == "model.path=_a_b_c,strategy.threshold=0.5,strategy=threshold"
    assert job_dirname([]) == "default"
    long1 = job_dirname([f"prompts=[{'x' * 300}]"])
    long2 = job_dirname([f"prompts=[{'x' * 299}y]"])
    assert len(long1) == 120 and long1 != long2 and "/" not in long1


def test_resolver_is_registered_on_import():
    from omegaconf import OmegaConf

    c = OmegaConf.create({"o": ["b=1", "a=/x"], "d": "${dlm_job_dir:${o}}"})
    assert c.d == "a=_x,b=1"


# ------------------------------------------------------------------------------------------- resume
def _cfg(**kw):
    from omegaconf import OmegaConf

    base = {"strategy": {"name": "threshold", "threshold": 0.9}, "cache": {"name": "none"},
            "task": {"name": "prompts"}, "gen_length": 16, "resume": True, "print_outputs": True}
    base.update(kw)
    return OmegaConf.create(base)


SUMMARY = {"strategy": {"name": "threshold", "threshold": 0.9}, "cache": {"name": "none"}, "model": "m",
           "model_digest": "sha256:0", "nfe": 4, "nfe_per_prompt": 2.0, "tpf": 4.0, "tps": 10.0, "wall_time": 1.0,
           "generated_tokens": 16, "prompts": 2, "versions": {"dlm_engine": "0"}, "trace": "trace.dlmt",
           "trace_digest": "sha256:abc"}


def test_resume_decisions(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep_jobs, "in_multirun", lambda: True)
    job = JobRecord(_cfg(), tmp_path)
    assert not job.should_skip()  # nothing there yet
    job.start()
    res = job.finish(dict(SUMMARY))
    assert res["trace"] == {"path": "trace.dlmt", "digest": "sha256:abc"}
    assert res["metrics"]["tps"] == 10.0 and "resume" not in res["config"]
    assert JobRecord(_cfg(print_outputs=False), tmp_path).should_skip()  # neutral keys do not matter
    assert "skipped, result.json exists" in capsys.readouterr().out
    # a result written under older metric definitions (batch-dependent TPF) is never reused
    old = json.loads((tmp_path / "result.json").read_text())
    assert old["metrics_version"] == METRICS_VERSION
    (tmp_path / "result.json").write_text(json.dumps(dict(old, metrics_version=1)))
    assert not JobRecord(_cfg(), tmp_path).should_skip()
    assert "older metric definitions" in capsys.readouterr().out
    (tmp_path / "result.json").write_text(json.dumps(old))
    assert not JobRecord(_cfg(resume=False), tmp_path).should_skip()
    assert "resume=false, re-running" in capsys.readouterr().out
    assert not JobRecord(_cfg(gen_length=32), tmp_path).should_skip()
    assert "config changed" in capsys.readouterr().out
    monkeypatch.setattr(sweep_jobs, "in_multirun", lambda: False)
    assert not JobRecord(_cfg(), tmp_path).should_skip()  # a single run is never skipped
    # a new attempt first removes the old outcome; a failure leaves error.json, not result.json
    monkeypatch.setattr(sweep_jobs, "in_multirun", lambda: True)
    job = JobRecord(_cfg(gen_length=32), tmp_path)
    job.start()
    assert not (tmp_path / "result.json").exists()
    job.fail(ValueError("boom"))
    err = json.loads((tmp_path / "error.json").read_text())
    assert err["status"] == "failed" and err["error"] == "boom" and err["strategy"]["name"] == "threshold"


# ------------------------------------------------------------------------------------------- aggregation
def _write_result(d, name, threshold, block, acc, nfe, tps, metrics_version=METRICS_VERSION):
    job = d / name
    job.mkdir(parents=True)
    ov = ["strategy=threshold", f"strategy.threshold={threshold}", f"strategy.block_length={block}"]
    (job / "result.json").write_text(json.dumps({
        "status": "ok", "metrics_version": metrics_version, "overrides": ov, "strategy": {"name": "threshold", "threshold": threshold, "block_length": block},
        "cache": {"name": "none"}, "model": "tiny", "task": "tiny_mix",
        "metrics": {"accuracy": acc, "nfe_per_prompt": nfe, "nfe": nfe * 4, "tpf": 16 / nfe, "tps": tps,
                    "wall_time": 1.0, "job_time": 2.0, "generated_tokens": 64, "prompts": 4,
                    "accuracy_by_task": {"add": acc, "pick": acc / 2}},
        "trace": {"path": "trace.dlmt", "digest": f"sha256:{name}"},
        "config": {"strategy": {"name": "threshold"}, "gen_length": 16}}))


@pytest.fixture
def fake_sweep(tmp_path):
    d = tmp_path / "sw"
    _write_result(d, "a", 0.5, 8, 0.50, 2.0, 300.0)   # front
    _write_result(d, "b", 0.9, 8, 0.80, 4.0, 200.0)   # front
    _write_result(d, "c", 0.5, 16, 0.40, 3.0, 250.0)  # dominated by a
    _write_result(d, "d", 0.9, 16, 0.80, 5.0, 150.0)  # dominated by b (same accuracy, more NFE)
    e = d / "e"
    e.mkdir()
    (e / "error.json").write_text(json.dumps({"status": "failed", "error": "strategy.block_length=5 bad",
                                              "overrides": ["strategy=threshold", "strategy.block_length=5"],
                                              "strategy": {"name": "threshold", "block_length": 5}}))
    f = d / "f" / ".hydra"
    f.mkdir(parents=True)
    (f / "overrides.yaml").write_text("- strategy=threshold\n- strategy.threshold=0.7\n- strategy.block_length=8\n")
    (f / "config.yaml").write_text("strategy:\n  name: threshold\n  threshold: 0.7\n  block_length: 8\n")
    (d / ".submitit" / "x").mkdir(parents=True)  # launcher internals are not scanned
    return d


def test_results_under_older_metric_definitions_are_stale(fake_sweep, capsys):
    _write_result(fake_sweep, "old", 0.3, 8, 0.9, 1.0, 999.0, metrics_version=None)  # would dominate everything
    report = aggregate(fake_sweep, plots=False)
    assert report["counts"]["stale"] == 1 and report["counts"]["ok"] == 4
    with open(fake_sweep / "sweep.csv") as f:
        rows = {r["job"]: r for r in csv.DictReader(f)}
    assert rows["old"]["status"] == "stale" and rows["old"]["pareto"] == ""
    assert {k for k, r in rows.items() if r["pareto"] == "True"} == {"a", "b"}
    assert "stale: old" in capsys.readouterr().out


def test_aggregate_table_pareto_and_plots(fake_sweep, capsys):
    report = aggregate(fake_sweep)
    assert report["counts"] == {"ok": 4, "failed": 1, "incomplete": 1}
    with open(fake_sweep / "sweep.csv") as f:
        rows = {r["job"]: r for r in csv.DictReader(f)}
    assert set(rows) == set("abcdef")
    assert {k for k, r in rows.items() if r["pareto"] == "True"} == {"a", "b"}
    assert rows["c"]["pareto"] == rows["d"]["pareto"] == "False" and rows["e"]["pareto"] == ""
    assert rows["a"]["strategy.threshold"] == "0.5" and rows["a"]["strategy.block_length"] == "8"
    assert rows["a"]["accuracy.pick"] == "0.25" and rows["a"]["trace_digest"] == "sha256:a"
    assert rows["e"]["status"] == "failed" and "block_length=5 bad" in rows["e"]["error"]
    assert rows["f"]["status"] == "incomplete" and rows["f"]["strategy.threshold"] == "0.7"
    header = next(csv.reader(open(fake_sweep / "sweep.csv")))
    assert header[:5] == ["job", "status", "strategy", "strategy.threshold", "strategy.block_length"]
    md = (fake_sweep / "sweep.md").read_text().splitlines()
    assert md[0] == "| status | strategy.threshold | strategy.block_length | accuracy | NFE/seq | TPF | TPS | Pareto |"
    assert len(md) == 2 + 6
    for png in ("accuracy_vs_nfe.png", "tps.png"):
        assert (fake_sweep / png).read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "6 jobs" in out and "failed: e: strategy.block_length=5 bad" in out and "hydra.sweep.dir=" in out


def test_dlm_sweep_command(fake_sweep, tmp_path, capsys):
    assert sweep.main([str(fake_sweep), "--no-plots"]) == 1  # a failed and an incomplete job
    assert not (fake_sweep / "tps.png").exists() and (fake_sweep / "sweep.csv").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert sweep.main([str(empty)]) == 1
    assert "no jobs under" in capsys.readouterr().out
    assert sweep.main([str(tmp_path / "missing")]) == 2


@pytest.mark.slow
def test_without_matplotlib_the_table_is_written_and_the_hint_given(fake_sweep):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from dlm_engine.sweeps.cli import main\n"
            f"sys.exit(main([{str(fake_sweep)!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # the fake sweep has a failed and an incomplete job
    assert "Traceback" not in proc.stderr
    assert (fake_sweep / "sweep.csv").is_file() and not list(fake_sweep.glob("*.png"))
    assert 'pip install "dlm-engine[viz]"' in proc.stdout


# ------------------------------------------------------------------------------------------- presets
def _sweeper_params(overrides):
    from hydra import compose, initialize_config_module

    from dlm_engine.app.config import register_configs
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    register_configs()
    with initialize_config_module(config_module="dlm_engine.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(params)
        jobs = BasicSweeper.split_arguments(parsed, None)[0]
        configs = [compose(config_name="config", overrides=overrides + job) for job in jobs]
    return jobs, configs


@pytest.mark.slow
@pytest.mark.parametrize("preset, n, keys", [
    ("threshold_grid", 12, {"strategy", "strategy.threshold", "strategy.block_length"}),
    ("all_strategies", 15, {"strategy"}),
    ("block_buffer_sizes", 8, {"strategy", "strategy.block_length", "strategy.buffer_size", "strategy.accept_threshold"}),
    ("caches", 10, {"strategy", "cache", "strategy.threshold", "batch_size"}),
])
def test_presets_expand_to_valid_jobs(preset, n, keys):
    from dlm_engine.app.run import validate

    jobs, configs = _sweeper_params([f"+sweep={preset}"])
    assert len(jobs) == n
    assert {o.split("=")[0] for job in jobs for o in job} == keys
    for cfg in configs:
        validate(cfg)  # every job of a preset passes the pre-model checks at the default gen_length
    if preset == "caches":
        from dlm_engine.core.registry import CACHES

        assert {c.cache.name for c in configs} == set(CACHES) - {"block_store", "block_kv"}    # every one threshold pairs with
    if preset == "all_strategies":
        from dlm_engine.core.registry import STRATEGIES

        every = {"low_confidence", "threshold", "factor", "early_exit", "cadllm", "block_buffer", "d2c", "klass",
                 "ar", "wino", "edit", "dmax"}
        assert {c.strategy.name for c in configs} == every and every <= set(STRATEGIES)


def test_slurm_preset_composes():
    from hydra import compose, initialize_config_module

    from dlm_engine.app.config import register_configs

    register_configs()
    with initialize_config_module(config_module="dlm_engine.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm_gpu", "hydra.launcher.partition=p1"],
                      return_hydra_config=True)
    la = cfg.hydra.launcher
    assert la._target_.endswith("SlurmLauncher") and la.partition == "p1" and la.gpus_per_node == 1
    assert la.timeout_min > 0 and la.submitit_folder.endswith(".submitit/%j")


# ------------------------------------------------------------------------------------------- a real failing sweep
@pytest.mark.slow
def test_every_job_is_checked_before_the_first_one_runs(tmp_path):
    """Bad values and unsupported strategy x cache pairs are reported together, and nothing runs."""
    d = tmp_path / "sw"
    proc = run_dlm(["-m", f"hydra.sweep.dir={d}", "strategy=threshold", "strategy.block_length=5,8",
                    "cache=glob([n*,p*,block_s*])", 'prompts=["12+34="]', "gen_length=16", "device=cpu",
                    "trace.record=false"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "dlm: error: 4 of 6 jobs of the sweep have invalid configs (no job was run):"
    assert sorted(lines[1:]) == sorted([
        "  strategy.block_length=5 cache=none: gen_length=16 is not divisible by strategy.block_length=5",
        "  strategy.block_length=5 cache=prefix: gen_length=16 is not divisible by strategy.block_length=5",
        "  strategy.block_length=5 cache=block_store: gen_length=16 is not divisible by strategy.block_length=5",
        "  strategy.block_length=8 cache=block_store: " + lines[-1].split("cache=block_store: ")[-1]])
    assert "strategy=threshold does not provide what cache=block_store needs" in lines[-1]
    assert not d.exists() or not any(d.iterdir())


@pytest.mark.slow
def test_glob_sweep_of_valid_jobs_runs_clean(tmp_path):
    """The glob() example of docs/sweeps.md: every cache the strategy supports (the block stores excluded)."""
    d = tmp_path / "sw"
    proc = run_dlm(["-m", f"hydra.sweep.dir={d}", "strategy=threshold", "cache=glob(*,exclude=[block_store,block_kv])",
                    'prompts=["12+34="]', "device=cpu", "trace.record=false"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(d / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["cache"], r["status"]) for r in rows) == [("d2cache", "ok"), ("dllm", "ok"), ("dual", "ok"),
                                                                ("none", "ok"), ("prefix", "ok")]
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------- progress
def test_progress_bar_only_on_a_terminal_and_log_lines_in_multirun_jobs(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    from dlm_engine.app.sinks import ProgressSink

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sweep_jobs, "in_multirun", lambda: True)
    monkeypatch.setattr(sweep_jobs, "in_launcher_worker", lambda: False)
    p = ProgressSink(8)
    assert not p.bar.disable and not p.log_lines  # basic launcher on a terminal: a bar
    monkeypatch.setattr(sweep_jobs, "in_launcher_worker", lambda: True)
    p = ProgressSink(8, log_interval=3600)
    assert p.bar.disable and p.log_lines  # joblib / submitit worker: no bar, log lines
    with caplog.at_level(logging.INFO, logger="dlm_engine.progress"):
        p.on_end(SimpleNamespace(batch_size=4))  # throttled
        p.on_end(SimpleNamespace(batch_size=4))  # the last batch is always logged
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["decoded 8/8 prompts"]
    assert not ProgressSink(8, enabled=False).log_lines  # progress=false: silent
    monkeypatch.setattr(sweep_jobs, "in_multirun", lambda: False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    p = ProgressSink(8)
    assert p.bar.disable and p.log_lines  # a single run without a terminal logs lines too


def test_without_a_terminal_a_long_batch_logs_every_interval_with_rate_and_eta(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    from dlm_engine.app import sinks

    clock = [100.0]
    monkeypatch.setattr(sinks.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    p = sinks.ProgressSink(20, log_interval=10)
    canvas = SimpleNamespace(batch_size=10)
    with caplog.at_level(logging.INFO, logger="dlm_engine.progress"):
        for step in range(1, 7):           # one batch of 10: 6 steps of 4 s each
            clock[0] += 4
            p.on_delta(SimpleNamespace(step=step), canvas)
        p.on_end(canvas)                   # 10/20 after 24 s: the last line was 0 s ago, so no line
        clock[0] += 30
        p.on_end(canvas)                   # the last prompt: always a line
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "decoded 0/20 prompts (12.0 s, 0.0 prompts/s, ETA unknown) (batch of 10 at step 3)",
        "decoded 0/20 prompts (24.0 s, 0.0 prompts/s, ETA unknown) (batch of 10 at step 6)",
        "decoded 20/20 prompts (54.0 s, 0.4 prompts/s, ETA 0.0 s)"]


def test_long_tables_are_cut_on_screen_only(fake_sweep, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "MAX_PRINTED_ROWS", 2)
    aggregate(fake_sweep, plots=False)
    assert "... 4 more rows in sweep.md" in capsys.readouterr().out
    assert len((fake_sweep / "sweep.md").read_text().splitlines()) == 8


def test_accuracy_plot_shows_every_strategy_even_at_the_same_point():
    """Three strategies with identical accuracy and NFE (block_buffer buffer_size=1 is threshold): each keeps
    its own marker and legend entry, every point is drawn exactly at its value, one number beside the spot names
    all three and the key beside the plot lists each."""
    pytest.importorskip("matplotlib", reason="plots need the 'viz' extra (matplotlib)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dlm_engine.sweeps.plots import accuracy_figure, clusters

    rows = [{"status": "ok", "strategy": s, "accuracy": a, "nfe_per_prompt": n, "pareto": p}
            for s, a, n, p in [("threshold", 0.98, 2.56, True), ("block_buffer", 0.98, 2.56, True),
                               ("factor", 0.98, 2.56, True), ("low_confidence", 1.0, 16.0, True)]]
    groups = {r["strategy"]: [r] for r in rows}
    fig = accuracy_figure(plt, rows, "strategy", groups, [])
    ax, side = fig.axes
    labels = [t.get_text() for t in side.get_legend().get_texts()]
    assert labels == ["strategy=block_buffer", "strategy=factor", "strategy=low_confidence", "strategy=threshold",
                      "Pareto front"]
    points = sorted(tuple(map(float, xy)) for c in ax.collections for xy in c.get_offsets())
    assert points == sorted((r["nfe_per_prompt"], r["accuracy"]) for r in rows)
    markers = {c.get_paths()[0].vertices.tobytes() for c in ax.collections}
    assert len(markers) == 4
    assert sorted(t.get_text() for t in ax.texts) == ["1,2,3", "4"]
    assert [t.get_text() for t in side.texts] == ["\n".join([
        " 1  strategy=block_buffer: 0.98 at NFE 2.56", " 2  strategy=factor: 0.98 at NFE 2.56",
        " 3  strategy=threshold: 0.98 at NFE 2.56", " 4  strategy=low_confidence: 1 at NFE 16"])]
    plt.close(fig)
    assert clusters([(10, 10), (11, 10), (200, 50)]) == [[0, 1], [2]]
