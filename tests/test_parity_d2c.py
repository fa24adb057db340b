"""d2Cache-framework parity of the caches (tests/fixtures/d2cparity): every case of the cache suites
(``d2c_prefix``, ``d2c_dllm``, ``d2c_d2cache``, whatever its strategy) runs through ``experiments/parity.py``
unless the reference itself raised, and matches tokens, NFE and unmask steps (the shared compare.py)."""
import json
import subprocess
import sys

import pytest

from conftest import FIXTURES

pytestmark = [pytest.mark.slow, pytest.mark.parity]

D2C = FIXTURES / "d2cparity"
CACHE_SUITES = ("d2c_prefix", "d2c_dllm", "d2c_d2cache")


def test_every_cache_case_runs_and_matches(d2c_candidates, tmp_path):
    cands, stdout = d2c_candidates
    wanted, errors = [], []
    for suite in CACHE_SUITES:
        for case in json.loads((D2C / f"{suite}.json").read_text())["cases"]:
            (errors if "error" in case else wanted).append(case["id"])
    assert len(wanted) >= 58 and not [w for w in wanted if w not in cands], stdout[-3000:]
    assert all(f"not run  {e}: reference raised" in stdout for e in errors)
    path = tmp_path / "cand.json"
    path.write_text(json.dumps({"cases": [cands[w] for w in wanted]}))
    proc = subprocess.run([sys.executable, str(FIXTURES / "compare.py"), str(D2C), str(path),
                           "--suites", ",".join(CACHE_SUITES)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"{len(wanted)} match, 0 mismatch" in proc.stdout
