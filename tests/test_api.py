"""The Python API: dlm_engine.generate / Session compose the `dlm` config, accept strings or token ids, return
per-sequence results, record traces, keep the model loaded; the README snippet runs as printed."""
import json
import re
import subprocess
import sys

import pytest

import dlm_engine
from conftest import ROOT, run_dlm
from dlm_engine.errors import ConfigError, UserError


def readme_snippet():
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python API\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_snippet_runs_as_printed(tmp_path):
    code = readme_snippet()
    assert len(code.strip().splitlines()) <= 10
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "347+085=" in proc.stdout and "TPF" in proc.stdout


@pytest.fixture(scope="module")
def session():
    return dlm_engine.Session(model="tiny", device="cpu")


@pytest.mark.slow
def test_generate_equals_the_command_line_run(session, tmp_path):
    prompts = ["123+456=", "name a fruit:", "sum 9:"]
    out = session.generate(prompts, strategy="threshold", cache="dual", batch_size=2)
    proc = run_dlm([f"hydra.run.dir={tmp_path / 'r'}", "strategy=threshold", "cache=dual", "batch_size=2",
                    "device=cpu", f"prompts={json.dumps(prompts)}", "trace.record=false"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert [(r.prompt, r.text, r.tokens, r.nfe, r.tpf) for r in out] == [
        (r["prompt"], r["text"], r["tokens"], r["nfe"], r["tpf"]) for r in rows]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert out.metrics["tpf"] == pytest.approx(summary["tpf"]) and out.metrics["nfe"] == summary["nfe"]
    assert out.config.strategy.name == "threshold" and out.config.cache.name == "dual"


@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_strings_token_ids_and_chat_objects_mix(session):
    ids = session.lm.encode("347+085=")
    out = session.generate(["347+085=", ids, {"prompt": "347+085=", "id": 3}], strategy="low_confidence",
                           cache="none", **{"strategy.steps": 8})
    assert out[0].tokens == out[1].tokens == out[2].tokens and out[0].text == "0432"
    assert out[1].prompt is None and out[2].extra["meta"] == {"id": 3}
    assert all(r.metrics["nfe"] == 8 and r.metrics["tpf"] == r.generated_tokens / 8 for r in out)
    assert out.metrics["sequences"] == 3 and out.metrics["nfe"] == 24 and "model_calls" in out.metrics
    # a dict names a preset and its options
    again = session.generate(["347+085="], strategy={"name": "low_confidence", "steps": 8}, cache="none")
    assert again[0].tokens == out[0].tokens


@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_the_model_is_loaded_once_per_session(monkeypatch):
    import dlm_engine.app.api as api

    calls = []
    real = api.load_model
    monkeypatch.setattr(api, "load_model", lambda *a, **k: calls.append(a) or real(*a, **k))
    s = dlm_engine.Session(model="tiny", device="cpu")
    s.generate(["12+34="], strategy="threshold")
    s.generate(["12+34="], strategy="factor", cache="prefix", gen_length=8, **{"strategy.block_length": 8})
    assert len(calls) == 1
    dlm_engine.generate(["12+34="], device="cpu")
    dlm_engine.generate(["56+78="], strategy="low_confidence", cache="none", device="cpu")
    assert len(calls) == 2  # the module-level generate keeps its model for the same model options


def test_bad_values_raise_the_one_line_the_command_prints(session):
    with pytest.raises(ConfigError, match=r"^strategy=treshold: no such strategy .*did you mean strategy=threshold\?$"):
        session.generate(["x"], strategy="treshold")
    with pytest.raises(ConfigError, match=r"^strategy.treshold: unknown key; did you mean strategy.threshold\?$"):
        session.generate(["x"], strategy="threshold", **{"strategy.treshold": 0.5})
    with pytest.raises(ConfigError, match="gen_length=10 is not divisible by strategy.block_length=4"):
        session.generate(["x"], gen_length=10, **{"strategy.block_length": 4})
    with pytest.raises(UserError, match="model options are fixed"):
        session.generate(["x"], device="cpu")
    with pytest.raises(UserError, match="prompt 1: expected"):
        session.generate(["x", 3.5])
    with pytest.raises(UserError, match=r"prompt 0: token id 5000 is outside the vocabulary of model 'tiny' \(0\.\.127\)"):
        session.generate([[5, 5000]])


def test_trace_recorded_to_a_path(session, tmp_path):
    from dlm_engine.trace import open_trace

    out = session.generate(["12+34=", "name a color:"], strategy="threshold", cache="dual", trace=tmp_path / "run.dlmt",
                           batch_size=1)
    assert out.trace == str(tmp_path / "run.dlmt")
    tr = open_trace(out.trace, recover=False)
    assert [s.text for s in tr] == out.texts and [s.nfe for s in tr] == [r.nfe for r in out]
    assert tr.config["strategy"]["name"] == "threshold" and tr.config["cache"]["name"] == "dual"
    # the header records the generator state the decode started from: the seeded one (not whatever came before)
    assert tr.header["rng"].get("torch_cpu_seed") == tr.header["seed"] and "torch_cpu_b64" not in tr.header["rng"]
    with pytest.raises(UserError, match="must be a file in an existing directory"):
        session.generate(["x"], trace=tmp_path / "missing" / "t.dlmt")


def test_run_prompts_accepts_strings_and_rejects_junk_with_one_line(session):
    from dlm_engine.app.api import run_prompts
    from dlm_engine.core.registry import cache_class, strategy_class

    lm = session.lm
    S, C = strategy_class("threshold"), cache_class("none")
    args = (lambda: S(S.Config(), 16), lambda: C(C.Config()), 16, 4)
    stats = run_prompts(lm, ["123+456=", lm.encode("123+456=")], *args)
    assert stats.rows[0].tokens == stats.rows[1].tokens and stats.rows[0].prompt == "123+456="
    with pytest.raises(UserError, match=r"^prompt 1: expected a string, a list of token ids"):
        run_prompts(lm, ["ok", None], *args)


def test_one_public_module_whose_defaults_are_dlms():
    """Issue 49 item 4: ``dlm_engine`` is the one public Python API (``generate``, ``Session``, ``Results``) and an
    argument left out is what ``dlm`` runs without it: the config a bare ``Session().config()`` composes is the
    command line's, but for the three keys an API call sets (no progress bar, no printed rows, no trace file)."""
    import inspect

    from omegaconf import OmegaConf

    from dlm_engine.app.compose import compose

    assert {"generate", "Session", "Results"} <= set(dlm_engine.__all__)
    for name in dlm_engine.__all__:
        assert getattr(dlm_engine, name) is not None
    for fn in (dlm_engine.generate, dlm_engine.Session.generate, dlm_engine.Session.__init__):
        params = inspect.signature(fn).parameters
        assert all(params[k].default is None for k in ("strategy", "cache", "model", "device", "dtype")
                   if k in params), fn
    api = OmegaConf.to_container(dlm_engine.Session().config(), resolve=True)
    cli = OmegaConf.to_container(compose([]), resolve=True)
    assert (api.pop("progress"), api.pop("print_outputs"), api["trace"].pop("record")) == (False, False, False)
    cli.pop("progress"), cli.pop("print_outputs"), cli["trace"].pop("record")
    assert api == cli
    assert api["strategy"]["name"] == "low_confidence" and api["cache"]["name"] == "none"
