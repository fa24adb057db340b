"""A strategy added from outside the package runs through `dlm`; the new strategies' bad values are
one-line user errors naming the key; constraints reach the canvas through the normal `dlm` path."""
import json
import textwrap

import pytest

from conftest import run_dlm

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
            return None
        return StepPlan(window=(canvas.gen_start, canvas.length))

    def select(self, canvas, plan, proposal, state):
        cand = candidates(canvas, proposal, canvas.length)
        commit = cand & (cand.cumsum(-1) <= self.cfg.tokens_per_step)
        return self.delta(canvas, proposal, commit, scalars={"committed": commit.sum(-1)}), state
'''

PRESET = """\
# preset of an outside strategy: extends the schema its decorator stored
defaults:
  - left_to_right_schema
  - _self_
tokens_per_step: 2
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
