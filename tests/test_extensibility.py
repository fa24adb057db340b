"""A strategy added from outside the package runs through `dlm`; the new strategies' bad values are
one-line user errors naming the key; constraints reach the canvas through the normal `dlm` path."""
import json
import textwrap

import pytest

from conftest import run_dlm

pytestmark = pytest.mark.slow     # starts processes (see pyproject.toml's markers)

PLUGIN = '''
"""A third-party strategy: commit the leftmost masked positions, ``tokens_per_step`` at a time."""
from dataclasses import dataclass

from dlm_engine.core.registry import register_strategy
from dlm_engine.core.strategy import StepPlan, Strategy, candidates


@dataclass
class LeftToRightConfig:
    name: str = "left_to_right"
    tokens_per_step: int = 1


@register_strategy("left_to_right", LeftToRightConfig)
class LeftToRight(Strategy):
    def validate(self):
        self.check_positive("tokens_per_step", self.cfg.tokens_per_step)

    def plan(self, canvas, state):
        if not bool(canvas.masked().any()):
            return None, state
        return StepPlan(window=(canvas.gen_start, canvas.length)), state

    def select(self, canvas, plan, proposal, state):
        cand = candidates(canvas, proposal, canvas.length)
        commit = cand & (cand.cumsum(-1) <= self.cfg.tokens_per_step)
        return self.delta(canvas, proposal, commit, scalars={"committed": commit.sum(-1)}), state
'''

PRESET = """\
# preset of an outside strategy: extends the schema its decorator stored
defaults:
  - /schema/strategy/left_to_right@_here_
  - _self_
tokens_per_step: 2
"""

CACHE_PLUGIN = '''
"""A third-party cache: recompute the block and everything after it, but refresh every second call."""
from dataclasses import dataclass

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.kvcache import StoredKVCache
from dlm_engine.core.registry import register_cache


@dataclass
class EveryOtherConfig:
    name: str = "every_other"
    refresh_interval: int = 2


@register_cache("every_other", EveryOtherConfig)
class EveryOther(StoredKVCache):
    offers = caps(Cap.BLOCK_LOGITS, Cap.SUFFIX_LOGITS)

    def compute_span(self, call, d, refresh):
        L = call.length
        return (0 if refresh else d.block[0]), L, L
'''

CACHE_PRESET = """\
defaults:
  - /schema/cache/every_other@_here_
  - _self_
"""


def test_strategy_from_outside_the_package_runs_through_dlm(tmp_path):
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "my_l2r.py").write_text(textwrap.dedent(PLUGIN))
    (tmp_path / "conf" / "strategy").mkdir(parents=True)
    (tmp_path / "conf" / "strategy" / "left_to_right.yaml").write_text(PRESET)
    out = tmp_path / "run"
    env = {"DLM_ENGINE_PLUGINS": "my_l2r", "PYTHONPATH": str(tmp_path / "plug")}
    proc = run_dlm(["--config-dir", str(tmp_path / "conf"), "strategy=left_to_right", f"hydra.run.dir={out}",
                    "device=cpu", "trace.record=false", "gen_length=16", "prompts=[abc,hello]"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["abc", "hello"]
    for r in rows:
        assert r["nfe"] == 8                                   # 16 positions, 2 per step (from the preset)
        assert r["step_of"] == [1 + i // 2 for i in range(16)]  # strictly left to right
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == {"name": "left_to_right", "tokens_per_step": 2}


@pytest.mark.parametrize("args, key", [
    (["strategy=threshold", "strategy.threshold=1.5"], "strategy.threshold=1.5"),
    (["strategy=factor", "strategy.factor=0"], "strategy.factor=0"),
    (["strategy=early_exit", "strategy.answer_start=40"], "strategy.answer_start=40"),
    (["strategy=block_buffer", "strategy.buffer_size=0"], "strategy.buffer_size=0"),
])
def test_bad_values_are_one_line_errors(tmp_path, args, key):
    out = tmp_path / "run"
    proc = run_dlm([f"hydra.run.dir={out}", "device=cpu", "trace.record=false", *args], cwd=tmp_path)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and key in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (out / "summary.json").exists()


def test_early_exit_constraints_through_dlm(tmp_path):
    out = tmp_path / "run"
    proc = run_dlm([f"hydra.run.dir={out}", "device=cpu", "trace.record=false", "strategy=early_exit",
                    "strategy.constraints=[[0,65],[3,66]]", "strategy.answer_start=4", "prompts=[abc]"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    row = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert row["tokens"][0] == 65 and row["tokens"][3] == 66
    assert row["step_of"][0] == 0 and row["step_of"][3] == 0          # given, never committed by a step


def test_cache_from_outside_the_package_runs_with_every_compatible_strategy(tmp_path):
    """A cache registered by a plug-in module pairs with every strategy whose needs it meets (computed from
    capabilities, no name lists) and is refused, naming the missing capability, by the others."""
    from dlm_engine.core.capabilities import incompatibility
    from dlm_engine.core.registry import STRATEGIES, load_plugins

    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "my_cache.py").write_text(textwrap.dedent(CACHE_PLUGIN))
    (tmp_path / "conf" / "cache").mkdir(parents=True)
    (tmp_path / "conf" / "cache" / "every_other.yaml").write_text(CACHE_PRESET)
    env = {"DLM_ENGINE_PLUGINS": "my_cache", "PYTHONPATH": str(tmp_path / "plug")}

    import importlib
    import sys

    sys.path.insert(0, str(tmp_path / "plug"))
    try:
        load_plugins()
        cache_cls = importlib.import_module("my_cache").EveryOther
        gen = 16
        ok, refused = [], []
        for name, cls in STRATEGIES.items():
            strategy = cls(cls.Config(), gen)
            (ok if incompatibility(strategy, cache_cls()) is None else refused).append(name)
    finally:
        sys.path.remove(str(tmp_path / "plug"))
        from dlm_engine.core.registry import CACHES

        CACHES.unregister("every_other")
        sys.modules.pop("my_cache", None)
    assert {"low_confidence", "threshold", "factor", "block_buffer"} <= set(ok)
    assert "early_exit" in refused
    for name in ok:
        out = tmp_path / f"run_{name}"
        proc = run_dlm(["--config-dir", str(tmp_path / "conf"), f"strategy={name}", "cache=every_other",
                        f"hydra.run.dir={out}", "device=cpu", "trace.record=false", 'prompts=["12+34="]',
                        "print_outputs=false"], cwd=tmp_path, env=env)
        assert proc.returncode == 0, (name, proc.stderr)
        assert json.loads((out / "summary.json").read_text())["cache"]["name"] == "every_other"
    out = tmp_path / "refused"
    proc = run_dlm(["--config-dir", str(tmp_path / "conf"), "strategy=early_exit", "cache=every_other",
                    f"hydra.run.dir={out}", "device=cpu", "trace.record=false"], cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "window_logits" in proc.stderr and "Traceback" not in proc.stderr
