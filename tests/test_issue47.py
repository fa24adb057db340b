"""Issue 47 (a new researcher's trial): the in-process checks of its bugs and friction points, one test (or a few)
per item; the command-line ones are marked slow."""
import pytest

from dlm_engine.app.compose import compose
from dlm_engine.errors import ConfigError, UserError


# -- item 1: a preset that runs another strategy's loop is named by the preset ------------------------------------
@pytest.mark.parametrize("preset", ["pc_sampler", "eb_sampler", "certainty_prior"])
def test_sweep_rows_and_refusals_name_the_preset(preset):
    from omegaconf import OmegaConf

    from dlm_engine.app.run import validate
    from dlm_engine.sweeps.tables import rows_from_jobs

    cfg = compose([f"strategy={preset}"])
    job = {"_dir": preset, "strategy": OmegaConf.to_container(cfg.strategy), "cache": {"name": "none"},
           "overrides": [f"strategy={preset}"], "metrics": {}}
    rows, cols, _, _ = rows_from_jobs([job, dict(job, _dir="d2c", strategy={"name": "d2c"}, overrides=["strategy=d2c"])])
    assert sorted(r["strategy"] for r in rows) == sorted(["d2c", preset])
    assert "strategy.preset" not in cols
    old = dict(job, strategy={k: v for k, v in job["strategy"].items() if k != "preset"})   # written before the label
    assert rows_from_jobs([old])[0][0]["strategy"] == preset
    with pytest.raises(ConfigError, match=f"strategy={preset} does not provide"):
        validate(compose([f"strategy={preset}", "cache=block_store"]))


def test_the_preset_label_leaves_the_job_digest_alone():
    from dlm_engine.app.jobs import config_digest

    a, b = compose(["strategy=pc_sampler"]), compose(["strategy=pc_sampler"])
    b.strategy.preset = None
    assert config_digest(a) == config_digest(b)


# -- item 3: one set of defaults -------------------------------------------------------------------------------
@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_the_python_api_runs_dlms_defaults():
    """Session/generate left to their defaults compose what `dlm` runs without arguments (conf/config.yaml): the
    API restated threshold + dual cache where `dlm` runs low_confidence + none."""
    from omegaconf import OmegaConf

    import dlm_engine

    api = OmegaConf.to_container(dlm_engine.Session().config())
    cli = OmegaConf.to_container(compose([]))
    for key in ("strategy", "cache", "model", "gen_length", "batch_size", "seed", "device", "dtype", "threads"):
        assert api[key] == cli[key], key
    assert api["strategy"]["name"] == "low_confidence" and api["cache"]["name"] == "none"   # (dlm's, today)
    # a strategy preset that picks its cache does so through the API too (cadllm -> dual), as on the command line
    assert dlm_engine.Session().config(strategy="cadllm").cache.name == compose(["strategy=cadllm"]).cache.name


# -- item 4: a key added with `+` that no schema has is an error --------------------------------------------------
@pytest.mark.parametrize("override, line", [
    ("+strategy.treshold=0.7", "strategy.treshold: unknown key; did you mean strategy.threshold?"),
    ("+cache.refresh=2", "cache.refresh: unknown key (keys of cache: name)"),
    ("+model.pth=x", "model.pth: unknown key; did you mean model.path?"),
    ("+gen_lenght=8", "gen_lenght: unknown key; did you mean gen_length?"),
])
def test_added_unknown_keys_are_errors_in_the_python_api(override, line):
    import dlm_engine

    with pytest.raises(ConfigError) as err:
        dlm_engine.Session().config(strategy="threshold", overrides=[override])
    assert str(err.value) == line


@pytest.mark.slow
def test_added_unknown_key_is_an_error_on_the_command_line(tmp_path):
    from conftest import run_dlm

    r = run_dlm(["strategy=threshold", "+strategy.treshold=0.7", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "dlm: error: strategy.treshold: unknown key; did you mean strategy.threshold?"
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.fixture(scope="module")
def tiny_lm():
    from dlm_engine.app.api import load_directory

    return load_directory()


# -- item 5: token-id prompts on the command line are ids ----------------------------------------------------------
def test_token_id_prompts_in_the_config_are_ids(tiny_lm):
    from dlm_engine.app.run import load_inputs

    cfg = compose(["prompts=[[5,6,7],'12+34=',1234]"])
    inputs = load_inputs(cfg, tiny_lm)
    assert inputs["ids"][0] == [5, 6, 7]
    assert inputs["ids"][1] == tiny_lm.encode("12+34=") and inputs["ids"][2] == tiny_lm.encode("1234")
    with pytest.raises(UserError, match=r"^prompt 0: token id 99999 is outside the vocabulary of model 'tiny' "
                                        r"\(0\.\.127\)$"):
        load_inputs(compose(["prompts=[[5,6,99999]]"]), tiny_lm)
    with pytest.raises(ConfigError, match=r"^prompts\[0\]: expected"):
        load_inputs(compose(["prompts=[[5,'x']]"]), tiny_lm)


@pytest.fixture(scope="module")
def wino_trace(tmp_path_factory):
    """A WINO trace whose row 1 writes a position at step 4 that step 5 re-masks (the embedded model)."""
    import dlm_engine
    from dlm_engine.trace import open_trace

    path = tmp_path_factory.mktemp("wino") / "w.dlmt"
    dlm_engine.generate(["347+085=", "name a fruit:", "sum 9:", "901-256="], strategy="wino", trace=path)
    e = open_trace(str(path))[1].edits
    assert e is not None and e["start"].tolist() == [4] and e["end"].tolist() == [5]
    return path


def _show_steps(capsys, path, seq):
    from dlm_engine.trace.cli import main

    assert main(["show", str(path), "--seq", str(seq)]) == 0
    out = capsys.readouterr().out.split(f"steps of row {seq}")[1].splitlines()
    col = out[1].split().index("commit") - 1          # ("wall ms" is two words of the header)
    return {int(line.split()[0]): int(line.split()[col]) for line in out[2:] if line.split() and line.split()[0].isdigit()}


# -- item 6: show's commit column counts every write of a step ---------------------------------------------------
def test_show_counts_writes_that_are_re_masked_later(wino_trace, capsys):
    from dlm_engine.trace import open_trace

    commits = _show_steps(capsys, wino_trace, 1)
    seq = open_trace(str(wino_trace))[1]
    assert commits[4] == 1 == int((seq.step_of == 4).sum()) + 1     # the write step 5 re-masked
    assert commits == {t: int(n) for t, n in enumerate(seq.commits_per_step()) if t in commits}


# -- item 7: a batch size a trace cannot hold is refused before loading, in the run's terms ------------------------
@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_a_batch_size_beyond_the_trace_limit_is_checked_before_loading(monkeypatch):
    from dlm_engine.app import api
    from dlm_engine.app.run import validate

    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(ConfigError, match=r"^batch_size=100000 is more than a trace records in one batch \(65536 "
                                          r"rows\): use batch_size<=65536, or trace\.record=false$"):
        validate(compose(["batch_size=100000", "task.n=70000"]))
    validate(compose(["batch_size=100000", "task.n=70000", "trace.record=false"]))
    validate(compose(["batch_size=100000", "task.n=20"]))           # 20 prompts: batches of 20


def test_the_trace_header_holds_the_batch_the_run_decodes(tmp_path):
    """batch_size=100000 with 4 prompts records (the header said 100000, beyond what a reader accepts)."""
    import dlm_engine
    from dlm_engine.trace import open_trace

    out = dlm_engine.generate(["1+1=", "2+2=", "sum 9:", "name a fruit:"], batch_size=100000,
                              trace=tmp_path / "t.dlmt")
    tr = open_trace(out.trace, recover=False)
    assert tr.header["shape"]["batch_size"] == 4 and len(tr) == 4


# -- item 8: a file given as model.path is not "missing" ----------------------------------------------------------
def test_a_file_as_model_path_is_reported_as_not_a_directory(tmp_path):
    from dlm_engine.app.run import validate

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(UserError, match=rf"^model\.path: '{f}' is a file, not a directory \(give the checkpoint "
                                        r"directory that holds config\.json and the weights\); model=local: "):
        validate(compose(["model=local", f"model.path={f}"]))


# -- item 9: the low-level API checks gen_length against the strategy's --------------------------------------------
def test_run_prompts_refuses_a_strategy_built_for_another_length(tiny_lm):
    from dlm_engine.app.api import run_prompts
    from dlm_engine.core.registry import cache_class, strategy_class

    T, D = strategy_class("threshold"), cache_class("dual")
    with pytest.raises(UserError, match=r"^gen_length=16 but the strategy was built for gen_length=32 "
                                        r"\(Threshold\(config, 32\)\): build it with the same length$"):
        run_prompts(tiny_lm, ["1+1="], lambda: T(T.Config(block_length=32), 32), lambda: D(D.Config()), 16, 2)


# -- item 10: generate(None) is the UserError other bad prompts get ------------------------------------------------
@pytest.mark.parametrize("prompts, kind", [(None, "NoneType"), (5, "int"), (b"12+34=", "bytes"), (object(), "object")])
def test_prompts_that_are_no_collection_are_a_user_error(prompts, kind):
    import dlm_engine

    with pytest.raises(UserError, match=r'^prompts: expected a prompt or a list of prompts \(strings, token-id lists, '
                                        r'\{"prompt": \.\.\.\} or \{"messages": \[\.\.\.\]\}\), got ' + kind + "$"):
        dlm_engine.generate(prompts)


def test_a_tensor_of_token_ids_is_a_list_of_prompts():
    import torch

    import dlm_engine

    out = dlm_engine.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    assert [r.prompt_ids for r in out] == [[5, 6, 7], [8, 9, 10]]


# -- item 12: dlm-trace diff compares each row on its own steps ----------------------------------------------------
def test_diff_compares_rows_on_their_own_steps(tmp_path, capsys):
    """threshold with blocks at batch 4 (rows whose block is done sit steps out) against the same prompts one at a
    time: every row commits the same positions in the same order of its own steps, so there is no divergence."""
    import dlm_engine
    from dlm_engine.trace import open_trace
    from dlm_engine.trace.cli import main
    from dlm_engine.trace.tools import diff

    prompts = ["347+085=", "name a fruit:", "sum 9:", "901-256=", "name a metal:", "12+34="]
    kw = dict(strategy={"name": "threshold", "block_length": 4})
    a = dlm_engine.generate(prompts, batch_size=6, trace=tmp_path / "a.dlmt", **kw)
    b = dlm_engine.generate(prompts, batch_size=1, trace=tmp_path / "b.dlmt", **kw)
    ta, tb = open_trace(a.trace), open_trace(b.trace)
    assert [s.step_of.tolist() for s in ta] != [s.step_of.tolist() for s in tb]    # the batch steps differ ...
    d = diff(ta, tb)
    assert d["first"] is None and d["rows_identical"] == len(prompts)             # ... the rows' own steps do not
    assert main(["diff", a.trace, b.trace]) == 0
    out = capsys.readouterr().out
    assert "each row is compared on its own steps" in out and "no divergence" in out


# -- item 13: the sweep plot labels every point by what varies and never moves one --------------------------------
def test_caches_sweep_plot_labels_every_point_and_draws_it_at_its_value():
    pytest.importorskip("matplotlib", reason="plots need the 'viz' extra (matplotlib)")
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    import matplotlib.pyplot as plt

    from dlm_engine.sweeps.plots import _group_key, accuracy_figure
    from dlm_engine.sweeps.tables import format_value, mark_pareto

    rows = [{"status": "ok", "strategy": "threshold", "cache": c, "strategy.threshold": t, "accuracy": a,
             "nfe_per_prompt": n}
            for c, t, a, n in [("dual", 0.9, 0.95, 5.5), ("prefix", 0.9, 0.95, 5.6), ("none", 0.9, 0.95, 5.5),
                               ("dual", 0.7, 0.85, 4.0), ("prefix", 0.7, 0.8, 4.1), ("none", 0.7, 0.9, 4.2)]]
    mark_pareto(rows)
    vary = ["cache", "strategy.threshold"]
    group = _group_key(rows, vary)
    assert group == "cache"                             # the legend names the caches, not the threshold
    groups = {}
    for r in rows:
        groups.setdefault(format_value(r[group]), []).append(r)
    fig = accuracy_figure(plt, rows, group, groups, ["strategy.threshold"])
    ax, side = fig.axes
    fig.canvas.draw()
    for c in ax.collections:                            # every marker exactly at its value on screen
        off = c.get_offsets()
        assert np.allclose(c.get_offset_transform().transform(off), ax.transData.transform(off))
    key = side.texts[0].get_text().splitlines()         # every point numbered and keyed with what varies
    assert sorted(int(n) for t in ax.texts for n in t.get_text().split(",")) == list(range(1, len(rows) + 1))
    for r in rows:
        assert any(f"cache={r['cache']}, threshold={format_value(r['strategy.threshold'])}: "
                   f"{format_value(r['accuracy'])} at NFE {format_value(r['nfe_per_prompt'])}" in line for line in key)
    plt.close(fig)


# -- item 14: Dream's cache refusal says what enables the caches ---------------------------------------------------
@pytest.mark.parametrize("cache, hint", [("dual", True), ("prefix", True), ("d2cache", False), ("block_store", False)])
def test_dreams_cache_refusal_names_block_length_where_it_helps(cache, hint):
    from dlm_engine.app.run import validate

    with pytest.raises(ConfigError) as err:
        validate(compose(["strategy=dream", f"cache={cache}"]))
    said = str(err.value)
    assert said.startswith(f"cache={cache} does not provide what strategy=dream needs: 'window_logits'")
    assert ("; strategy.block_length=N (Fast-dLLM's block loop for Dream; N divides gen_length=16) enables "
            f"cache={cache}" in said) == hint
    if hint:
        validate(compose(["strategy=dream", f"cache={cache}", "strategy.block_length=8"]))   # and it does


# -- item 15: an empty prompt is decoded with a warning -----------------------------------------------------------
def test_an_empty_prompt_warns(tiny_lm, capsys):
    from dlm_engine.app.run import load_inputs

    load_inputs(compose(["prompts=['','12+34=','  ']"]), tiny_lm)
    assert capsys.readouterr().err.strip() == ("dlm: warning: prompts 0, 2 are empty: decoded without a prompt "
                                               "(unconditional generation)")
    import dlm_engine

    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        dlm_engine.generate([""])
    assert [str(w.message) for w in said] == ["prompt 0 is empty: decoded without a prompt (unconditional generation)"]


# -- item 16: a run without a terminal says at once what it decodes ------------------------------------------------
def test_a_run_without_a_terminal_logs_what_it_decodes_at_the_start(tmp_path, monkeypatch, caplog):
    import logging
    import sys

    from dlm_engine.app.run import run

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    cfg = compose(["strategy=pc_sampler", "prompts=['1+1=','2+2=','3+3=']", "trace.record=false", "batch_size=2"])
    with caplog.at_level(logging.INFO, logger="dlm_engine.progress"):
        run(cfg, tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "dlm_engine.progress"]
    assert lines[0] == "decoding 3 prompts, batch 2, strategy pc_sampler, cache none, gen_length 16, model tiny"
    assert lines[-1].startswith("decoded 3/3 prompts")


# -- item 18: replay --step shows masked positions in its text -----------------------------------------------------
def test_replay_at_a_step_shows_the_masked_positions_in_the_text(wino_trace, capsys):
    import json

    from dlm_engine.trace.cli import main

    assert main(["replay", str(wino_trace), "--step", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["masked"] for r in rows)
    for r in rows:
        assert r["text"].count("\u2592") + r["text"].count("\u2591") == r["masked"]
    assert rows[1]["text"] == "\u2592i\u2592e"          # (the embedded model, WINO: 'lime' half decoded)


# -- item 19: dlm --version is dlm_engine's -----------------------------------------------------------------------
def test_dlm_version_prints_dlm_engines_version(monkeypatch, capsys):
    import sys

    import hydra

    from dlm_engine import __version__
    from dlm_engine.app.cli import main

    monkeypatch.setattr(sys, "argv", ["dlm", "--version"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0
    assert capsys.readouterr().out == f"dlm_engine {__version__} (hydra {hydra.__version__})\n"


# -- item 21: the strategy x cache table in the docs is the one the code generates --------------------------------
@pytest.mark.slow      # (generating the page decides every strategy x cache x family pair: ~70 s on 2 cores)
def test_the_compatibility_page_is_what_the_code_generates():
    from pathlib import Path

    from dlm_engine.app.compat import DOC, markdown, pairs

    root = Path(__file__).resolve().parents[1]
    assert (root / DOC).read_text(encoding="utf-8") == markdown(), \
        "docs/compatibility.md is stale: python -m dlm_engine.app.compat docs/compatibility.md"
    table = {(s, c): why for s, c, why in pairs()}
    assert table[("threshold", "dual")] is None and "block_handover" in table[("threshold", "block_store")]
    assert "strategy.block_length=N" in table[("dream", "dual")]
