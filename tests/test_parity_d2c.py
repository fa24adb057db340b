"""d2Cache-framework parity (tests/fixtures/d2cparity): ``experiments/parity.py`` runs every suite file in one
subprocess and the shared compare.py checks tokens, NFE and unmask steps. Every case of the cache suites
(``d2c_prefix``, ``d2c_dllm``, ``d2c_d2cache``) runs unless the reference itself raised or its strategy is not
implemented yet; all of them match."""
import json
import subprocess
import sys

import pytest

from conftest import FIXTURES, run_parity

D2C = FIXTURES / "d2cparity"
CACHE_SUITES = ("d2c_prefix", "d2c_dllm", "d2c_d2cache")


@pytest.fixture(scope="module")
def d2c_run(tmp_path_factory):
    return run_parity(D2C, tmp_path_factory.mktemp("d2c"))


def test_every_d2c_case_that_runs_matches(d2c_run):
    out, _ = d2c_run
    n = len(json.loads(out.read_text())["cases"])
    proc = subprocess.run([sys.executable, str(FIXTURES / "compare.py"), str(D2C), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"{n} match, 0 mismatch" in proc.stdout


def test_every_cache_case_runs(d2c_run):
    """Nothing in the cache suites is left out for a cache reason: the only cases not run are reference errors
    and strategies that do not exist yet."""
    out, stdout = d2c_run
    ran = {c["id"] for c in json.loads(out.read_text())["cases"]}
    not_run = {line.split()[2].rstrip(":"): line for line in stdout.splitlines() if line.startswith("not run")}
    counted = 0
    for suite in CACHE_SUITES:
        for case in json.loads((D2C / f"{suite}.json").read_text())["cases"]:
            cid = case["id"]
            if cid in ran:
                counted += 1
                continue
            why = not_run.get(cid, "missing")
            assert "reference raised" in why or "is not implemented yet" in why and "strategy" in why, why
    assert counted >= 52          # 24 prefix/dual + 12 dLLM-Cache + 16 d2Cache cases of the vanilla strategy
