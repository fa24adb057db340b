"""Reference parity of low_confidence: every llada.json case and every no-cache fixed-schedule
fastdllm_v2.json case (tokens, NFE and unmask steps), through the parity command."""
import pytest

from conftest import compare_with_reference, fixture_ids

pytestmark = [pytest.mark.slow, pytest.mark.parity]


def test_llada_suite_matches(parity_candidates, tmp_path):
    cands, _ = parity_candidates
    ids = fixture_ids("llada")
    assert len(ids) >= 6
    code, out = compare_with_reference(cands, ids, tmp_path)
    assert code == 0, out
    assert f"{len(ids)} match, 0 mismatch" in out


def test_fastdllm_fixed_schedule_no_cache_matches(parity_candidates, tmp_path):
    cands, _ = parity_candidates

    def fixed_no_cache(c):
        kw = c["kwargs"]
        return c["function"] == "generate" and kw.get("threshold") is None and kw.get("factor") is None

    ids = fixture_ids("fastdllm_v2", fixed_no_cache)
    assert len(ids) >= 2
    code, out = compare_with_reference(cands, ids, tmp_path)
    assert code == 0, out


def test_parity_command_lists_what_it_cannot_run(parity_candidates):
    """Every fixture case is either in the candidate file or listed by id as not run."""
    import json

    from conftest import REFPARITY

    cands, stdout = parity_candidates
    for suite in ("llada", "fastdllm_v2", "cadllm", "prophet"):
        for case in json.loads((REFPARITY / f"{suite}.json").read_text())["cases"]:
            assert case["id"] in cands or case["id"] in stdout, case["id"]
