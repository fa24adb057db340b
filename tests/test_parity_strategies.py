"""Reference parity of threshold, factor (no-cache fastdllm_v2.json cases) and early_exit (every
prophet.json case): tokens, NFE and unmask steps, compared with the fixtures' own compare.py.

The parity machinery of ``experiments/parity.py`` runs in-process on the selected cases only.
"""
import json

import pytest

from conftest import REFPARITY, compare_with_reference, fixture_ids

def _run(parity, model, suite, ids):
    data = json.loads((REFPARITY / f"{suite}.json").read_text())
    mask_id, pad_id = int(model.config.mask_token_id), int(model.config.pad_token_id)
    wanted = set(ids)
    return {c["id"]: parity.run_case(c, data["prompts"], model, mask_id, pad_id)
            for c in data["cases"] if c["id"] in wanted}


def _no_cache(kind):
    return lambda c: c["function"] == "generate" and c["kwargs"].get(kind) is not None


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("kind", ["threshold", "factor"])
def test_fastdllm_no_cache_cases_match(parity, tiny_llada, tmp_path, kind):
    ids = fixture_ids("fastdllm_v2", _no_cache(kind))
    assert len(ids) >= 2
    cands = _run(parity, tiny_llada, "fastdllm_v2", ids)
    code, out = compare_with_reference(cands, ids, tmp_path)
    assert code == 0, out
    assert f"{len(ids)} match, 0 mismatch" in out


@pytest.mark.slow
@pytest.mark.parity
def test_every_prophet_case_matches(parity, tiny_llada, tmp_path):
    ids = fixture_ids("prophet")
    assert len(ids) >= 5
    cands = _run(parity, tiny_llada, "prophet", ids)
    code, out = compare_with_reference(cands, ids, tmp_path)
    assert code == 0, out
    assert f"{len(ids)} match, 0 mismatch" in out
    # the reference's exit bookkeeping too (compare.py does not look at `extra`)
    ref = {c["id"]: c for c in json.loads((REFPARITY / "prophet.json").read_text())["cases"]}
    for cid in ids:
        assert cands[cid]["extra"]["exit_info"] == ref[cid]["extra"]["exit_info"], cid


def test_parity_maps_to_the_new_strategies(parity):
    """The suites map onto threshold / factor / early_exit, and prophet's absolute answer position becomes
    a generation-relative offset."""
    data = json.loads((REFPARITY / "prophet.json").read_text())
    case = next(c for c in data["cases"] if "constraints" in c["kwargs"])
    strategy, _, setup = parity.build(case)
    assert strategy.name == "early_exit"
    assert strategy.cfg.answer_start == case["kwargs"]["answer_start_pos"] - case["prompt_len"]
    assert strategy.constraints == {int(p): int(t) for p, t in case["kwargs"]["constraints"]}
    fd = json.loads((REFPARITY / "fastdllm_v2.json").read_text())
    names = {parity.build(c)[0].name for c in fd["cases"] if c["function"] == "generate"}
    assert {"threshold", "factor"} <= names
