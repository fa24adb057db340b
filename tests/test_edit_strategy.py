"""``edit``: LLaDA2.1's M2T + T2T decoding, token-exact against the reference (``bdparity`` suite ``llada21``: tokens,
NFE, last write per position, every write including the edits), post-edit steps, and the block store equal to the
recompute-everything path under edits."""
import json

import pytest
import torch

from conftest import FIXTURES, load_experiment, record_calls
from dlm_engine.app.sinks import RecordingSink
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class
from dlm_engine.errors import ConfigError
from dlm_engine.models.loader import load_pretrained

BD = FIXTURES / "bdparity"
SUITE = json.loads((BD / "llada21.json").read_text())
CASES = {c["id"]: c for c in SUITE["cases"]}
# the defaults, many edits at a low editing threshold, num_to_transfer 2, an EOS stop, the EOS in the prompt
QUICK = ["llada21/generate/defaults_bl8/p0/gl32_bl8", "llada21/generate/edit0.1_thr0.9/p3/gl32_bl8",
         "llada21/generate/ntt2/p2/gl32_bl8", "llada21/generate/eos_stop_gl16/p1/gl16_bl8",
         "llada21/generate/eos_in_prompt_eos_stop_thr0.8/p4/gl48_bl8"]


@pytest.fixture(scope="module")
def parity():
    return load_experiment("parity", "parity_llada21")


@pytest.fixture(scope="module")
def model():
    return load_pretrained(BD / "tiny_llada21")[0]


def _check(got, ref):
    assert got["output"] == ref["output"]
    assert got["nfe"] == ref["nfe"]
    assert got["unmask_step"] == ref["unmask_step"]
    assert got["events"] == ref["events"]


@pytest.mark.parametrize("cid", QUICK)
def test_cases_match_the_reference(parity, model, cid):
    case = CASES[cid]
    got = parity.run_case(case, SUITE["prompts"], model, SUITE["mask_id"], SUITE["pad_id"], SUITE)
    _check(got, case)


@pytest.mark.slow
def test_whole_suite_matches_the_reference(parity):
    results, skipped = parity.run_folder(BD, only="llada21/")
    assert not skipped and len(results) == len(SUITE["cases"])
    for got in results:
        _check(got, CASES[got["id"]])


def _decode(model, prompt, cache="none", gen=32, **kw):
    load_plugins()
    cls = strategy_class("edit")
    strategy = cls(cls.Config(**kw), gen)
    canvas = Canvas.from_prompts([prompt], gen, model.mask_token_id, 1017, eos_id=1017)
    c = cache_class(cache)(cache_class(cache).Config())
    calls = record_calls(c)
    rec = RecordingSink()
    decode(model, canvas, strategy, cache=c, sinks=[rec])
    return canvas, rec, [span for _, span, _ in calls]


@pytest.mark.parametrize("prompt_idx,bl", [(2, 8), (0, 8), (3, 4)])
def test_block_store_equals_recompute_under_edits(model, prompt_idx, bl):
    prompt = SUITE["prompts"][prompt_idx]
    kw = dict(block_length=bl, threshold=0.9, editing_threshold=0.3)
    ref, rec, _ = _decode(model, prompt, "none", **kw)
    got, _, spans = _decode(model, prompt, "block_store", **kw)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.step_of, ref.step_of) and got.nfe == ref.nfe
    edits = sum(int(d.scalars["edits"].sum()) for d in rec.deltas if "edits" in d.scalars)
    assert edits > 0                                       # the comparison covers rewritten tokens
    assert all(b - a <= 2 * bl for a, b in spans[1:])


def test_post_edit_steps_and_their_bound(model):
    prompt = SUITE["prompts"][1]
    canvas, rec, _ = _decode(model, prompt, block_length=8, threshold=0.95, editing_threshold=0.9, max_post_steps=16)
    posts = [d for d in rec.deltas if d.scalars.get("post_edit")]
    assert posts and not canvas.masked().any()
    # every block ends with a post-edit step that edits nothing
    last = {}
    for d in rec.deltas:
        if d.step > 0:
            last[d.scalars["block"]] = d
    assert all(d.scalars["post_edit"] and int(d.scalars["edits"].sum()) == 0 for d in last.values())
    none, rec0, _ = _decode(model, prompt, block_length=8, max_post_steps=0)
    assert not any(d.scalars.get("post_edit") for d in rec0.deltas if d.step > 0)
    assert none.nfe < canvas.nfe


def test_bad_settings_are_one_line_errors():
    load_plugins()
    cls = strategy_class("edit")
    with pytest.raises(ConfigError, match="strategy.max_post_steps=-1"):
        cls(cls.Config(max_post_steps=-1), 32)
    with pytest.raises(ConfigError, match=r"strategy.editing_threshold=1.5 is outside \[0, 1\]"):
        cls(cls.Config(editing_threshold=1.5), 32)
    with pytest.raises(ConfigError, match="strategy.editing_threshold=-0.1"):
        cls(cls.Config(editing_threshold=-0.1), 32)
    cls(cls.Config(editing_threshold=0.0), 32)          # 0: any changed argmax is written (SGLang's default)
    with pytest.raises(ConfigError, match="strategy.num_to_transfer=0"):
        cls(cls.Config(num_to_transfer=0), 32)


def test_a_post_edit_finish_after_the_last_write_stands():
    """Post-edit steps that write nothing still belong to the sequence: its explicit finish after its last write
    ends it (the metrics' finish step, and so its NFE), not the step of its last write."""
    import numpy as np

    from dlm_engine.metrics import finish_step

    steps = np.arange(1, 6)
    assert finish_step(steps, np.array([0, 0, 0, 0, 1], bool), np.array([1, 3, 2])) == 5
    assert finish_step(steps, np.array([0, 0, 1, 1, 1], bool), np.array([1, 3, 2])) == 3
    assert finish_step(steps, np.zeros(5, bool), np.array([1, 3, 2])) == 3


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_prefix_and_dual_caches_are_exact_under_edits(model, cache):
    """Every cache recomputes the working block (prompt tail included) at each step: edits there are seen, and the
    blocks before it are final; the decode equals the recompute-everything one."""
    prompt = SUITE["prompts"][2]
    kw = dict(block_length=8, threshold=0.9, editing_threshold=0.3)
    ref, _, _ = _decode(model, prompt, "none", **kw)
    got, _, spans = _decode(model, prompt, cache, **kw)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.step_of, ref.step_of) and got.nfe == ref.nfe
    assert any(a > 0 for a, _ in spans)


def test_repetition_penalty_option(model):
    from dlm_engine.strategies.edit import repetition_penalty

    logits = torch.zeros(3, 5)
    out = repetition_penalty(logits, torch.tensor([4, 1, 2]), 2.0)
    assert out[0].tolist() == [0.0] * 5 and logits.abs().sum() == 0                       # row 0 and the input kept
    assert out[1].tolist() == [0, 0, 0, 0, -2.0] and out[2].tolist() == [0, -2.0, 0, 0, 0]
    prompt = SUITE["prompts"][0]
    plain, _, _ = _decode(model, prompt, block_length=8)
    strong, rec, _ = _decode(model, prompt, block_length=8, penalty_lambda=1e4)
    assert not torch.equal(plain.tokens, strong.tokens)
    # a huge penalty: no proposal of a step repeats the token its left neighbour in the block held as the step began
    cur = torch.tensor([prompt + [model.mask_token_id] * 32])
    steps = [d for d in rec.deltas if d.step > 0]
    assert steps
    for d in steps:
        s, W = d.start, d.commit.shape[1]
        assert not (d.tokens[0, 1:] == cur[0, s:s + W - 1]).any()
        cur[0, s:s + W] = torch.where(d.commit[0], d.tokens[0], cur[0, s:s + W])
    assert torch.equal(cur, strong.tokens)
    with pytest.raises(ConfigError, match="strategy.penalty_lambda=-1"):
        strategy_class("edit")(strategy_class("edit").Config(penalty_lambda=-1.0), 32)
