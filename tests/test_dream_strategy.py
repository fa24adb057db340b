"""Dream's decoding rules (strategy ``dream``): reference parity of every Dream fixture case through the
parity command, the timestep schedules of docs/specs/dream.md, the block loop, batching and config errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.errors import ConfigError
from dlm_engine.core.loop import Sink, decode
from dlm_engine.models.loader import load_pretrained
from dlm_engine.core.registry import CACHES, cache_class, strategy_class

ROOT = Path(__file__).resolve().parents[1]
DREAM = ROOT / "tests" / "fixtures" / "dreamparity"
P0 = [406, 710, 869, 657, 230, 402]
P1 = [432, 865, 699, 373, 283, 101, 288, 776, 229, 914, 661]
P3 = [700, 122, 830, 105, 461, 112, 337, 830, 289, 310, 434]


@pytest.fixture(scope="module")
def model():
    return load_pretrained(DREAM / "tiny_dream", device="cpu", dtype="float32")[0]


class Counts(Sink):
    def __init__(self):
        self.per_step, self.nfe = [], 0

    def on_delta(self, delta, canvas):
        self.per_step.append(int(delta.commit.sum()))
        self.nfe += delta.nfe


def run(model, prompts, gen, cache="none", **kw):
    cls = strategy_class("dream")
    strategy = cls(cls.Config(**kw), gen)
    canvas = Canvas.from_prompts(prompts, gen, 1000, 1001)
    counts = Counts()
    decode(model, canvas, strategy, cache_class(cache)(cache_class(cache).Config()), [counts])
    return counts, canvas


@pytest.mark.slow
@pytest.mark.parity
def test_every_dream_fixture_case_matches_through_the_parity_command(tmp_path):
    """experiments/parity.py on the Dream fixtures folder, judged by the fixtures' own compare.py."""
    out = tmp_path / "dream.json"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "parity.py"), str(DREAM), str(out)],
                          capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 not run" in proc.stdout, proc.stdout
    cmp = subprocess.run([sys.executable, str(DREAM.parent / "compare.py"), str(DREAM), str(out)],
                         capture_output=True, text=True, timeout=120)
    n = sum(len(json.loads((DREAM / f).read_text())["cases"]) for f in ("dream.json", "dream_block.json"))
    assert cmp.returncode == 0, cmp.stdout
    assert f"{n} match, 0 mismatch" in cmp.stdout, cmp.stdout


@pytest.mark.parametrize("masks, steps, eps, expected", [
    (32, 32, 1e-3, [0] + [1] * 30 + [2]),
    (32, 16, 1e-3, [1] + [2] * 14 + [3]),
    (32, 12, 1e-3, [2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 4]),
    (16, 48, 1e-3, [0] * 33 + [1] * 14 + [2]),
    (32, 16, 0.1, [1, 1, 1, 1] + [2] * 11 + [6]),
])
def test_timestep_schedule(model, masks, steps, eps, expected):
    counts, canvas = run(model, [P0], masks, alg="maskgit_plus", steps=steps, eps=eps)
    assert counts.per_step == expected
    assert counts.nfe == steps and not canvas.masked().any()


@pytest.mark.parametrize("S, expected", [(4, [1, 2, 2, 3]), (8, [1, 0, 1, 1, 1, 1, 1, 2]), (2, [1, 7])])
def test_block_loop_schedule(model, S, expected):
    counts, canvas = run(model, [P0], 32, cache="prefix", alg="entropy", steps=4 * S, block_length=8)
    assert counts.per_step == expected * 4 and counts.nfe == 4 * S


def test_block_loop_one_step_per_block_leaves_masks(model):
    """S = 1: the block-start call commits the first position, one wasted cached call, the rest stays masked."""
    counts, canvas = run(model, [P0], 32, cache="dual", alg="entropy", steps=4, block_length=8)
    assert counts.per_step == [1, 0] * 4 and counts.nfe == 8
    assert int((canvas.tokens == 1000).sum()) == 28
    assert bool(canvas.finished.all())


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_block_loop_runs_with_every_cache(model, cache):
    counts, canvas = run(model, [P0], 16, cache=cache, alg="confidence_threshold", steps=2, block_length=8)
    assert not canvas.masked().any() and counts.nfe >= 4


def test_infilling_decodes_prompt_masks_and_position_zero(model):
    counts, canvas = run(model, [[1000, 406, 1000, 869]], 8, alg="entropy", steps=8)
    assert not (canvas.tokens == 1000).any()
    assert canvas.step_of[0, 0] > 0 and canvas.step_of[0, 2] > 0 and canvas.step_of[0, 1] == 0
    assert sum(counts.per_step) == 10


def test_infilling_can_be_switched_off(model):
    counts, canvas = run(model, [[406, 1000, 869]], 8, alg="entropy", steps=8, infill=False)
    assert canvas.tokens[0, 1] == 1000 and sum(counts.per_step) == 8


def test_confidence_threshold_batch_rows_equal_single_rows(model):
    """Beyond the reference (batch 1 only): per-row quota, carry and step growth."""
    _, batch = run(model, [P1, P3], 16, alg="confidence_threshold", steps=4, threshold=0.9)
    for r, p in enumerate([P1, P3]):
        counts, alone = run(model, [p], 16, alg="confidence_threshold", steps=4, threshold=0.9)
        assert batch.tokens[r].tolist() == alone.tokens[0].tolist()
        assert int(batch.row_nfe[r]) <= counts.nfe


def test_block_threshold_batch_rows_equal_single_rows(model):
    _, batch = run(model, [P1, P3], 16, cache="dual", alg="confidence_threshold", steps=2, block_length=8)
    for r, p in enumerate([P1, P3]):
        _, alone = run(model, [p], 16, cache="dual", alg="confidence_threshold", steps=2, block_length=8)
        assert batch.tokens[r].tolist() == alone.tokens[0].tolist()


def test_origin_at_zero_temperature_uses_randomness(model):
    torch.manual_seed(0)
    _, a = run(model, [P0], 16, alg="origin", steps=8)
    torch.manual_seed(1)
    _, b = run(model, [P0], 16, alg="origin", steps=8)
    assert not a.masked().any() and not b.masked().any()
    assert a.step_of.tolist() != b.step_of.tolist()


def test_alg_temp_and_filters_run_seeded_and_reproducibly(model):
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        _, c = run(model, [P0, P1], 16, alg="entropy", steps=8, temperature=0.8, top_p=0.9, top_k=20, alg_temp=0.5)
        outs.append(c.tokens.tolist())
    assert outs[0] == outs[1]


def test_reference_arguments_map_to_the_config(parity):
    """The parity adapter (not the strategy) knows diffusion_generate's defaults and argument names."""
    def case(kw, suite="dream"):
        return {"id": f"{suite}/x", "function": "diffusion_generate", "kwargs": kw, "prompt_len": 6}

    st = parity.setup_for(case({"max_new_tokens": 32}))
    conf = st.config
    assert (conf.alg, conf.steps, conf.eps, conf.temperature, conf.block_length) == ("origin", 512, 1e-3, 0.0, None)
    assert (st.cache, st.gen_length) == ("none", 32)
    st = parity.setup_for(case({"dual_cache": True, "alg": "entropy", "steps": 4, "max_new_tokens": 32}, "dream_block"))
    assert st.config.window == "block" and st.config.block_length == 32 and st.cache == "dual"
    with pytest.raises(parity.Unsupported, match="no_such_argument"):
        parity.setup_for(case({"no_such_argument": 1}))


@pytest.mark.parametrize("kw, needle", [
    ({"alg": "greedy"}, "strategy.alg"),
    ({"steps": 0}, "strategy.steps"),
    ({"eps": 1.5}, "strategy.eps"),
    ({"temperature": -1.0}, "strategy.temperature"),
    ({"top_p": 0.0}, "strategy.top_p"),
    ({"top_k": 0}, "strategy.top_k"),
    ({"alg_temp": -0.1}, "strategy.alg_temp"),
    ({"threshold": 1.5}, "strategy.threshold"),
    ({"window": "all"}, "strategy.window"),
    ({"alg": "confidence_threshold", "steps": 5}, "strategy.steps"),
    ({"block_length": 5}, "strategy.block_length"),
    ({"block_length": 8, "steps": 3}, "strategy.steps"),
])
def test_bad_config_names_the_key(kw, needle):
    cls = strategy_class("dream")
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        cls(cls.Config(**kw), 16)


def test_dream_loop_pairs_only_with_caches_that_give_every_logit():
    from dlm_engine.core.capabilities import incompatibility

    cls = strategy_class("dream")

    def pairs(strategy):
        return {n for n, c in CACHES.items() if incompatibility(strategy, c()) is None}

    assert pairs(cls(cls.Config(), 16)) == {"none", "dllm"}       # dLLM-Cache computes every column
    assert {"none", "prefix", "dual"} <= pairs(cls(cls.Config(block_length=8, steps=4), 16))
    assert "dual" not in pairs(cls(cls.Config(block_length=8, steps=4, window="rest"), 16))
    problem = incompatibility(cls(cls.Config(), 16), cache_class("dual")())
    assert "window_logits" in problem and "cache=dual" in problem
