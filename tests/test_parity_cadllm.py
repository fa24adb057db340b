"""cadllm: every cadllm.json case (tokens, NFE, unmask steps, vocab_size_history) with the dual cache,
the adaptive rules' arithmetic, per-step scalars, the Prophet commit as a real extra forward, defaults
and validation."""
import json

import numpy as np
import pytest
import torch

from conftest import REFPARITY, compare_with_reference, fixture_ids
from dlm_engine.strategies import _cadllm_rules as adaptive
from dlm_engine.core.canvas import Canvas
from dlm_engine.errors import ConfigError
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import cache_class, strategy_class
from dlm_engine.core.sampler import confidence_of
from dlm_engine.app.sinks import RecordingSink

CAD = strategy_class("cadllm")
PROMPT = [735, 559, 771, 678, 375, 377]
BASE = dict(initial_steps=8, max_steps=24, initial_block_length=16, max_block=32, min_block=4)


@pytest.fixture(scope="module")
def results(tiny_llada, parity):
    data = json.loads((REFPARITY / "cadllm.json").read_text())
    return {c["id"]: (c, parity.run_case(c, data["prompts"], tiny_llada, 1000, 1001))
            for c in data["cases"] if "error" not in c}


@pytest.mark.slow
@pytest.mark.parity
def test_every_cadllm_case_matches(results, tmp_path):
    ids = fixture_ids("cadllm")
    assert len(ids) >= 9 and set(ids) == set(results)
    code, out = compare_with_reference({i: r for i, (_, r) in results.items()}, ids, tmp_path)
    assert code == 0, out
    assert f"{len(ids)} match, 0 mismatch" in out


def test_vocab_size_history_matches(results):
    for cid, (case, res) in results.items():
        assert res["extra"]["vocab_size_history"] == case["extra"]["vocab_size_history"], cid


def _run(model, gen=64, cache="dual", seed=None, **kw):
    canvas = Canvas.from_prompts([PROMPT], gen, 1000, 1001)
    rec = RecordingSink()
    if seed is not None:
        torch.manual_seed(seed)
    decode(model, canvas, CAD(CAD.Config(**kw), gen), cache=cache_class(cache)(cache_class(cache).Config()),
           sinks=[rec])
    return canvas, rec


def test_per_step_scalars_and_block_events(tiny_llada):
    canvas, rec = _run(tiny_llada, **BASE)
    assert not canvas.masked().any()
    sizes = []
    for d in rec.deltas:
        s = d.scalars
        assert {"block_size", "steps", "threshold", "vocab_size"} <= set(s)
        if any(e.kind == "opened" for e in d.block_events):
            assert s["threshold"] == 0.85                      # step i = 0 of the block
            sizes.append(s["block_size"])
        assert 0.4 <= s["threshold"] <= 0.85 and 35 <= s["vocab_size"] <= 1000
    opened = [e for d in rec.deltas for e in d.block_events if e.kind == "opened"]
    completed = [e for d in rec.deltas for e in d.block_events if e.kind == "completed"]
    assert [(e.start, e.end) for e in opened] == [(e.start, e.end) for e in completed]
    assert sum(sizes) == 64 and len(set(sizes)) > 1           # adaptive block sizes tile the generation


def test_prophet_commit_is_a_separate_temperature_zero_forward(tiny_llada):
    kw = dict(BASE, prophet_enabled=True, min_confidence_gap=0.1, min_confidence_commit=0.3, temperature=0.5)
    canvas, rec = _run(tiny_llada, seed=1, **kw)
    fired = [i for i, d in enumerate(rec.deltas) if d.scalars.get("prophet_commit")]
    assert fired
    for i in fired:
        trigger, allin = rec.deltas[i], rec.deltas[i + 1]
        assert trigger.nfe == 1 and not trigger.commit.any()   # the step's own selection is discarded
        assert allin.nfe == 1 and "vocab_size" not in allin.scalars
        before = rec.states[i][0, allin.start:allin.start + allin.width] == 1000
        assert torch.equal(allin.commit[0], before)            # every masked block position at once
        assert any(e.kind == "completed" for e in allin.block_events)
    assert canvas.nfe == len(rec.deltas)


def test_cache_none_and_prefix_also_run(tiny_llada):
    for cache in ("none", "prefix"):
        canvas, _ = _run(tiny_llada, cache=cache, **BASE)
        assert not canvas.masked().any()


def test_adaptive_rules_arithmetic():
    assert adaptive.repetition_score([1, 2, 3]) == 0.0
    assert adaptive.repetition_score([1, 2, 3, 4, 5, 5, 5, 5]) == 1.0
    assert adaptive.repetition_score([9, 8, 1, 2, 3, 1, 2, 3]) == 3 / 8
    assert adaptive.repetition_score([1, 2, 3, 4, 1, 2, 3, 4]) == 4 / 8
    # block size: float32 mean of the last two entries, truncation, clamp, remaining
    H = [0.1, 0.3, 0.7]
    assert adaptive.block_size(H, 64, 16, 4, 32) == 4 + int(28 * float(np.float32((np.float32(0.3) + np.float32(0.7)) / 2)))
    assert adaptive.block_size([], 64, 40, 4, 32) == 32 and adaptive.block_size([], 10, 16, 4, 32) == 10
    assert adaptive.block_size(H, 64, 16, 4, 32, adaptive=False) == 16
    # steps: unscaled while H is empty, else scaled by size / initial size
    assert adaptive.step_budget([], 4, 8, 24, 16) == 8
    assert adaptive.step_budget([0.5, 0.5], 8, 8, 24, 16) == int((8 + int(16 * 0.5)) * 8 / 16)
    assert adaptive.step_budget([1.0], 1, 8, 24, 16) == 1
    # V_t: phase, confidence factor, falling-confidence boost, repetition x3, clip and truncation
    assert adaptive.vocab_size(0.1, [], [], 100, 35, 1000) == 800
    assert adaptive.vocab_size(0.5, [], [], 100, 35, 1000) == 70
    assert adaptive.vocab_size(0.9, [0.9], [], 100, 35, 1000) == 72
    assert adaptive.vocab_size(0.5, [0.9, 0.9, 0.5], [], 100, 35, 1000) == int(70 * 1.0 * 1.3)
    assert adaptive.vocab_size(0.5, [], [7] * 8, 100, 35, 1000) == 210
    assert adaptive.vocab_size(0.5, [], [7] * 8, 100, 35, 1000, repetition=False) == 70
    assert adaptive.vocab_size(0.5, [0.1], [], 15, 5, 35, adaptive=False) == 15
    # threshold: i counts from 0 at the block start, linear to 0.4 at i = steps, then flat
    assert adaptive.linear_threshold(0, 8) == 0.85
    assert adaptive.linear_threshold(4, 8) == 0.85 * 0.5 + 0.4 * 0.5
    assert adaptive.linear_threshold(12, 8) == 0.4


def test_top_v_confidences():
    logits = torch.tensor([[[3.0, 1.0, 0.5, -2.0, 0.0]]])
    x0 = torch.tensor([[3]])
    assert float(confidence_of(logits, x0, "prob", top_v=3)) == 0.0        # outside the top-V_t
    p = torch.softmax(torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64), -1)
    assert float(confidence_of(logits, torch.tensor([[1]]), "prob", top_v=3)) == float(p[1])
    q = torch.softmax(torch.tensor([3.0, 1.0]), -1)
    h = -(q * torch.log(q + 1e-12)).sum()
    assert torch.equal(confidence_of(logits, x0, "inv_entropy", top_v=2)[0, 0], 1.0 / (1.0 + h))
    assert confidence_of(logits, x0, "prob", top_v=50).shape == (1, 1)      # top-V larger than the vocabulary


def test_defaults_are_the_reference_signature_defaults():
    from dlm_engine.core.confidence import Confidence

    c = CAD.Config()
    assert (c.initial_steps, c.max_steps, c.initial_block_length, c.temperature, c.remasking, c.threshold,
            c.factor, c.adaptive_blocks, c.max_block, c.min_block, c.confidence_method, c.adaptive_vocab_size,
            c.repetition_detection, c.adaptive_steps, c.adaptive_threshold, c.prophet_enabled,
            c.min_confidence_gap, c.prophet_patience, c.min_confidence_commit) == \
        (8, 24, 32, 0.0, "low_confidence", None, None, True, 256, 8, Confidence.softmax, True, True, True, True,
         False, 0.3, 2, 0.6)
    assert c.confidence_method == "prob"          # the reference's softmax is the prob kind (docs/glossary.md)
    from dlm_engine.core.capabilities import incompatibility

    assert CAD.max_batch == 1 and incompatibility(CAD(c, 32), cache_class("dual")()) is None


@pytest.mark.parametrize("kw, key", [
    (dict(initial_steps=0), r"strategy\.initial_steps=0"),
    (dict(min_block=64, max_block=32), r"strategy\.min_block=64"),
    (dict(threshold=1.5), r"strategy\.threshold=1\.5"),
    (dict(factor=0.0), r"strategy\.factor=0\.0"),
    (dict(confidence_method="max"), r"strategy\.confidence_method='max'"),
    (dict(remasking="none"), r"strategy\.remasking='none'"),
    (dict(temperature=-1.0), r"strategy\.temperature=-1\.0"),
])
def test_bad_values_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        CAD(CAD.Config(**kw), 64)
