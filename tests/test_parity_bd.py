"""Block-diffusion parity (``tests/fixtures/bdparity``, the dense suites): Fast-dLLM v2 (``generate``,
``batch_sample``) and SDAR (evaluation sampler, ``generate.py``) through ``experiments/parity.py`` -- tokens, NFE,
the forward after which each position was last written and every write in order, against the references' own
runs; the settings the references raised on are refused with a clear error; a suite the project cannot run is
reported per case, never aborting the run."""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import FIXTURES

BD = FIXTURES / "bdparity"
# one case of each kind: quirks (prompt of one block, block 64, block cache, AR stop), sampled, batched
QUICK = ["fdv2/generate/sb8_thr0.4/p3/gl64_bl32", "fdv2/generate/sb16_thr0.9_bc/p4/gl128_bl64",
         "fdv2/generate/sb8_thr0.95_t1_topp0.8_bc/p2/gl64_bl32_seed6", "fdv2/batch_sample/sb4_thr0.4/b29/gl64_bl16",
         "fdv2/batch_sample/sb8_thr0.9_bc/b0149/gl64_bl16", "sdar/huggingface_bd3/dyn0.9_s8/p2/gl64_bl16",
         "sdar/huggingface_bd3/random_remasking/p1/gl32_bl8_seed1",
         "sdar/generate/dyn0.85_t1.0_s4_overwrite_mask_sampled/p3/gl32_bl16_seed8",
         "sdar/generate/static_topk1_s2_overwrite/p2/gl32_bl8"]


def compare(folder, candidates, tmp_path, suites):
    path = tmp_path / "cand.json"
    path.write_text(json.dumps({"cases": candidates}))
    proc = subprocess.run([sys.executable, str(BD / "compare.py"), str(folder), str(path), "--suites", suites],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def run_ids(parity, ids):
    out = []
    for cid in ids:
        res, skipped = parity.run_folder(BD, only=cid)
        out += [r for r in res if r["id"] == cid]
    return out


@pytest.mark.slow     # compare.py runs in a process
def test_one_case_of_each_kind_matches(parity, tmp_path):
    cands = run_ids(parity, QUICK)
    assert len(cands) == len(QUICK) and all("error" not in c for c in cands), cands
    assert all("events" in c for c in cands)
    code, out = compare(BD, cands, tmp_path, "fdv2,sdar")
    assert code == 0, out
    assert f"{len(QUICK)} match, 0 mismatch" in out


def test_reference_errors_are_refused_with_a_clear_message(parity):
    res, _ = parity.run_folder(BD, only="error")
    errors = {r["id"]: r.get("error", "") for r in res}
    assert set(errors) == {"sdar/generate/static_t2.0_mask_sampled_error/p4/gl32_bl4_seed5",
                           "sdar/generate/temperature0_error/p1/gl16_bl4"}
    assert "after denoising_steps=4 steps" in errors["sdar/generate/static_t2.0_mask_sampled_error/p4/gl32_bl4_seed5"]
    assert "temperature=0.0 must be > 0" in errors["sdar/generate/temperature0_error/p1/gl16_bl4"]
    res, _ = parity.run_folder(BD, only="fdv2/batch_sample/sb8_thr0.9/b0/")
    assert "every row finished in the first block" in res[0]["error"]


def test_a_suite_without_an_adapter_is_reported_per_case(parity, tmp_path):
    folder = tmp_path / "bd"
    folder.mkdir()
    shutil.copytree(BD / "tiny_sdar", folder / "tiny_sdar")
    data = json.loads((BD / "sdar.json").read_text())
    other = dict(data, suite="nosuch", cases=[dict(data["cases"][0], id="nosuch/generate/x/p0/gl8_bl4")])
    (folder / "nosuch.json").write_text(json.dumps(other))
    (folder / "sdar.json").write_text(json.dumps(dict(data, cases=data["cases"][:1])))
    res, skipped = parity.run_folder(folder)
    by = {r["id"]: r for r in res}
    assert "nosuch" in by["nosuch/generate/x/p0/gl8_bl4"]["error"]
    assert "output" in by[data["cases"][0]["id"]]


@pytest.mark.slow
@pytest.mark.parametrize("suite", ["fdv2", "sdar"])
def test_every_dense_case_matches(parity, tmp_path, suite):
    res, skipped = parity.run_folder(BD, only=f"{suite}/")
    ran = [r for r in res if "error" not in r]
    data = json.loads((BD / f"{suite}.json").read_text())
    assert len(ran) == sum("error" not in c for c in data["cases"])
    code, out = compare(BD, res, tmp_path, suite)
    assert code == 0, out
    assert f"{len(ran)} match, 0 mismatch" in out and "0 fixture cases not in candidate" in out
