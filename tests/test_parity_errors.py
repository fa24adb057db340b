"""experiments/parity.py: a reference call's left-out arguments take the d2Cache framework's code defaults (spec
d2cache.md §11), and one bad case never stops the command -- it is written as that case's ``error`` and the run
goes on."""
import copy
import json
import subprocess
import sys

import pytest

from conftest import FIXTURES

D2C = FIXTURES / "d2cparity"


def _suite(name):
    return json.loads((D2C / f"{name}.json").read_text())


def test_left_out_cache_arguments_take_the_reference_code_defaults(parity):
    assert parity.d2c_cache({"name": "d2cache", "class": "d2Cache", "args": {}}) == (
        "d2cache", {"rollout_p": 0.1, "current_k": 32, "sigma": 10.0, "inflate_w": 4})     # not the yaml's inflate_w 0
    assert parity.d2c_cache({"name": "d2cache", "args": {"current_k": 8}})[1]["inflate_w"] == 4
    assert parity.d2c_cache({"name": "d2cache", "args": {"inflate_w": 0}})[1]["inflate_w"] == 0
    assert parity.d2c_cache({"name": "dllm", "class": "dLLMCache", "args": None}) == (
        "dllm", {"kp": 50, "kr": 2, "rou": 0.25})                                             # not our kr 4
    assert parity.d2c_cache({"name": "prefix", "args": {}}) == ("prefix", {"shifted": "move"})
    with pytest.raises(parity.Unsupported, match="d2Cache cache 'nonesuch'"):
        parity.d2c_cache({"name": "nonesuch", "args": {}})


def test_left_out_generate_arguments_take_the_reference_code_defaults(parity):
    case = copy.deepcopy(_suite("d2c_vanilla")["cases"][0])
    del case["kwargs"]["block_length"]
    case["kwargs"]["gen_length"] = 64
    assert parity.setup_for(case).config.block_length == 32          # generate()'s default, not gen_length


@pytest.mark.parametrize("model", ["llada", "dream"])
def test_d2cache_built_without_inflate_w_matches_the_reference(parity, model):
    """The fixture case with inflate_w = 4, its cache built without that argument: the class default (4) applies and
    the output is the fixture's (the project's default, 0, gives another output)."""
    suite = _suite("d2c_d2cache")
    case = copy.deepcopy(next(c for c in suite["cases"] if c["model"] == model and c["cache"]["args"]["inflate_w"]))
    del case["cache"]["args"]["inflate_w"]
    model_obj = parity.load_pretrained(parity.model_dirs(D2C)[case["model_dir"]], device="cpu", dtype="float32")[0]
    res = parity.run_case(case, suite["prompts"], model_obj, 1000, 1001, suite)
    assert (res["output"], res["nfe"], res["unmask_step"]) == (case["output"], case["nfe"], case["unmask_step"])


@pytest.mark.slow
def test_one_bad_case_does_not_stop_the_parity_command(parity, tmp_path, capsys, monkeypatch):
    """A copy of the d2c_pc suite plus cases that fail in each way (an impossible threshold, an unsupported strategy,
    runtime errors, a model that cannot load): every good case still runs and matches, each bad one is its
    candidate's ``error``, the summary line counts them and the exit status is 0."""
    folder = tmp_path / "fixtures"
    folder.mkdir()
    (folder / "tiny_llada").symlink_to(FIXTURES / "refparity" / "tiny_llada", target_is_directory=True)
    (folder / "tiny_dream").symlink_to(FIXTURES / "dreamparity" / "tiny_dream", target_is_directory=True)
    (folder / "tiny_broken").mkdir()
    (folder / "tiny_broken" / "config.json").write_text("{not json")
    suite = _suite("d2c_pc")
    good = [c["id"] for c in suite["cases"]]
    base = suite["cases"][1]                                         # clip_alpha 2: debiased scores <= 2

    def bad(tag, **change):
        case = copy.deepcopy(base)
        case["id"] = base["id"].replace("pc_alpha2", tag)
        for key, value in change.items():
            if key == "kwargs":
                case["kwargs"].update(value)
            else:
                case[key] = value
        suite["cases"].insert(1, case)
        return case["id"]

    impossible = bad("pc_alpha2_thr3", kwargs={"threshold": 3.0})
    unsupported = bad("nonesuch", kwargs={"strategy": "nonesuch"})
    runtime = bad("no_prompt", prompt_idx=99)
    multiline = bad("multiline")
    real_run_case = parity.run_case

    def run_case(case, *args, **kw):         # an error whose message spans lines, as torch's do
        if case["id"] == multiline:
            raise RuntimeError("shapes do not match:\n  [1, 8] vs [1, 9]")
        return real_run_case(case, *args, **kw)

    monkeypatch.setattr(parity, "run_case", run_case)
    broken = bad("broken_model", model_dir="tiny_broken")
    (folder / "d2c_pc.json").write_text(json.dumps(suite))
    out = tmp_path / "candidate.json"

    assert parity.main([str(folder), str(out)]) == 0
    stdout = capsys.readouterr().out
    cands = {c["id"]: c for c in json.loads(out.read_text())["cases"]}
    assert sorted(cands) == sorted(good + [impossible, unsupported, runtime, multiline, broken])
    errors = {k: c["error"] for k, c in cands.items() if "error" in c}
    assert sorted(errors) == sorted([impossible, unsupported, runtime, multiline, broken])
    assert errors[impossible].startswith("ConfigError: strategy.threshold=3.0 is impossible for PC-Sampler's debiased "
                                         "confidences"), errors[impossible]
    assert errors[unsupported] == "Unsupported: d2Cache strategy 'nonesuch'"
    assert errors[runtime].startswith("IndexError: ")
    assert errors[multiline] == "RuntimeError: shapes do not match: [1, 8] vs [1, 9]"
    assert "tiny_broken" in errors[broken] and "\n" not in errors[broken]
    assert f"error    {impossible}: ConfigError: strategy.threshold=3.0" in stdout
    assert "parity: ran 6 cases, 5 errors, 0 not run" in stdout, stdout
    proc = subprocess.run([sys.executable, str(FIXTURES / "compare.py"), str(folder), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "6 match, 0 mismatch, 5 skipped" in proc.stdout, proc.stdout
