"""Issue 49 item 5: one pass down the request path. A ``dlm`` run (``app/run.py: run``) and a Python API call
resolve the checkpoint once, read the prompts file once and build the strategy once -- however many batches
the prompts take -- and the layers ``app``, ``sweeps``, ``trace`` and ``models`` import one another without cycles
(``tests/test_boundaries.py``)."""
import builtins
import io
import json

import pytest

import dlm_engine
from dlm_engine.app import inputs as inputs_mod
from dlm_engine.core import strategy as strategy_mod
from dlm_engine.models import checkpoint as checkpoint_mod


@pytest.fixture
def counts(monkeypatch, tmp_path):
    """Counts of checkpoint resolutions, prompts-file reads (parses and opens) and strategy constructions."""
    n = {"checkpoint": 0, "prompts_read": 0, "prompts_open": 0, "strategy": 0}
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("12+34=\n901-256=\nname a fruit:\nsum 9:\n5+5=\n")
    real_check, real_read, real_init, real_open = (checkpoint_mod.check_checkpoint, inputs_mod.read_prompts_file,
                                                   strategy_mod.Strategy.__init__, builtins.open)

    def check(*a, **k):
        n["checkpoint"] += 1
        return real_check(*a, **k)

    def read(*a, **k):
        n["prompts_read"] += 1
        return real_read(*a, **k)

    def init(self, *a, **k):
        n["strategy"] += 1
        return real_init(self, *a, **k)

    def opener(file, *a, **k):
        if str(file) == str(prompts):
            n["prompts_open"] += 1
        return real_open(file, *a, **k)

    monkeypatch.setattr(checkpoint_mod, "check_checkpoint", check)
    monkeypatch.setattr(inputs_mod, "read_prompts_file", read)
    monkeypatch.setattr(strategy_mod.Strategy, "__init__", init)
    monkeypatch.setattr(builtins, "open", opener)
    monkeypatch.setattr(io, "open", opener)          # (pathlib's Path.open / read_text / read_bytes)
    n["path"] = prompts
    return n


@pytest.mark.parametrize("record", [False, True])
def test_a_dlm_run_resolves_reads_and_builds_once(counts, tmp_path, record):
    from dlm_engine.app.compose import compose
    from dlm_engine.app.run import run

    cfg = compose(["model=tiny", "device=cpu", "strategy=threshold", "cache=dual", "gen_length=8", "batch_size=2",
                   f"prompts_file={counts['path']}", f"trace.record={str(record).lower()}", "progress=false",
                   "print_outputs=false"])
    out = tmp_path / "run"
    out.mkdir()
    summary = run(cfg, out)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert summary["prompts"] == len(rows) == 5                          # three batches of at most 2
    assert (counts["checkpoint"], counts["prompts_read"], counts["prompts_open"], counts["strategy"]) == (1, 1, 1, 1)
    assert (out / "trace.dlmt").is_file() == record


def test_a_python_api_call_resolves_and_builds_once(counts):
    s = dlm_engine.Session(model="tiny", device="cpu")
    out = s.generate(["12+34=", "901-256=", "5+5="], strategy="threshold", cache="dual", gen_length=8, batch_size=2)
    assert len(out) == 3
    assert (counts["checkpoint"], counts["strategy"]) == (1, 1)
    counts["checkpoint"] = counts["strategy"] = 0
    s.generate(["12+34="], strategy="low_confidence", gen_length=8)     # the model stays loaded
    assert (counts["checkpoint"], counts["strategy"]) == (1, 1)         # (the config is validated per call)
