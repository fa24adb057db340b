"""``llada2``: LLaDA2.0's block decoding, token-exact against the reference (``bdparity`` suite ``llada2``: tokens,
NFE, the forward after which each position was last written, every write), its schedule and stops, and the block
store equal to the reference's recompute-everything path while computing only the working block."""
import json

import pytest
import torch

from conftest import FIXTURES, load_experiment, record_calls
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class
from dlm_engine.errors import ConfigError
from dlm_engine.models.loader import load_pretrained

BD = FIXTURES / "bdparity"
SUITE = json.loads((BD / "llada2.json").read_text())
CASES = {c["id"]: c for c in SUITE["cases"]}
# greedy with the top-n_k fallback, minimal_topk, an early EOS stop, sampling with top-k and top-p
QUICK = ["llada2/generate/thr0.9_s2/p2/gl32_bl4", "llada2/generate/mintopk4_thr0.95/p0/gl16_bl8",
         "llada2/generate/eos_stop_gl16/p1/gl16_bl8", "llada2/generate/t1.0_topk20/p2/gl32_bl16_seed12",
         "llada2/generate/t0.7_topp0.9/p1/gl32_bl8_seed13", "llada2/generate/eos_in_prompt_no_eos_stop/p4/gl64_bl8"]


@pytest.fixture(scope="module")
def parity():
    return load_experiment("parity", "parity_llada2")


@pytest.fixture(scope="module")
def model():
    return load_pretrained(BD / "tiny_llada2")[0]


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
def test_whole_suite_matches_the_reference(parity, tmp_path):
    results, skipped = parity.run_folder(BD, only="llada2/")
    assert not skipped and len(results) == len(SUITE["cases"])
    for got in results:
        _check(got, CASES[got["id"]])
    out = tmp_path / "out.json"
    out.write_text(json.dumps({"cases": results}))
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, str(BD / "compare.py"), str(BD), str(out), "--suites", "llada2"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and f"{len(SUITE['cases'])} match, 0 mismatch" in proc.stdout


def test_unsupported_suites_are_reported_per_case(parity, tmp_path):
    """A suite without an adapter (or a model the project cannot load) becomes that case's error; the run goes on."""
    import shutil
    (tmp_path / "zzz.json").write_text(json.dumps({"suite": "zzz", "prompts": [[1, 2]], "cases": [
        {"id": "zzz/generate/x/p0/gl8", "model_dir": "tiny_llada2", "kwargs": {}, "prompt_idx": 0}]}))
    shutil.copytree(BD / "tiny_llada2", tmp_path / "tiny_llada2")
    case = dict(CASES[QUICK[0]])
    (tmp_path / "llada2.json").write_text(json.dumps(dict(SUITE, cases=[case])))
    results, skipped = parity.run_folder(tmp_path)
    by_id = {r["id"]: r for r in results}
    assert "unknown suite 'zzz'" in by_id["zzz/generate/x/p0/gl8"]["error"]
    assert by_id[QUICK[0]]["output"] == case["output"]


def _decode(model, prompt, cache="none", gen=48, **kw):
    load_plugins()
    cls = strategy_class("llada2")
    strategy = cls(cls.Config(**kw), gen)
    canvas = Canvas.from_prompts([prompt], gen, model.mask_token_id, 1017, eos_id=1017)
    c = cache_class(cache)(cache_class(cache).Config())
    calls = record_calls(c)
    decode(model, canvas, strategy, cache=c)
    return canvas, [span for _, span, _ in calls]


@pytest.mark.parametrize("prompt_idx,bl", [(2, 8), (0, 4), (3, 8)])
def test_block_store_equals_recompute_and_computes_the_working_block_only(model, prompt_idx, bl):
    prompt = SUITE["prompts"][prompt_idx]
    ref, _ = _decode(model, prompt, "none", block_length=bl, steps=bl, threshold=0.9)
    got, spans = _decode(model, prompt, "block_store", block_length=bl, steps=bl, threshold=0.9)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.step_of, ref.step_of) and got.nfe == ref.nfe
    P = len(prompt)
    assert spans[0][0] == 0
    for a, b in spans[1:]:
        assert a >= (P // bl) * bl and b - a <= 2 * bl        # the working block (plus the one it stores)
    assert any(b - a <= bl for a, b in spans[1:])


def test_schedule_and_commit_counts(model):
    sched = strategy_class("llada2").__module__
    import importlib
    mod = importlib.import_module(sched)
    assert mod.schedule(8, 3) == (3, 3, 2) and mod.schedule(4, 8) == (1, 1, 1, 1, 0, 0, 0, 0)
    # threshold 1 never passes: every step commits exactly n_k(s) (the fallback), so each block takes `steps` forwards
    canvas, _ = _decode(model, SUITE["prompts"][1], block_length=8, steps=4, threshold=1.0, gen=32)
    assert canvas.nfe == 4 * 4 and not canvas.masked().any()
    so = canvas.step_of[0, 16:].tolist()
    assert all(so.count(t) == 2 for t in range(1, 17))


def test_bad_settings_are_one_line_errors(model):
    cls = strategy_class("llada2")
    with pytest.raises(ConfigError, match="strategy.eos_search='x'"):
        cls(cls.Config(eos_search="x"), 32)
    with pytest.raises(ConfigError, match="strategy.minimal_topk=64"):
        cls(cls.Config(minimal_topk=64), 32)
    with pytest.raises(ConfigError, match="strategy.top_p"):
        cls(cls.Config(top_p=1.5), 32)
    canvas = Canvas.from_prompts([[1, 2], [3, 4]], 16, model.mask_token_id, 1017)
    with pytest.raises(ValueError, match="at most 1 row"):
        decode(model, canvas, cls(cls.Config(block_length=8, steps=8), 16))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_prefix_and_dual_caches_are_exact(model, cache):
    prompt = SUITE["prompts"][2]                       # 11 ids: the first block holds the prompt's tail
    ref, _ = _decode(model, prompt, "none", block_length=8, steps=8, threshold=0.9)
    got, spans = _decode(model, prompt, cache, block_length=8, steps=8, threshold=0.9)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.step_of, ref.step_of) and got.nfe == ref.nfe
    assert any(a > 0 for a, _ in spans)
