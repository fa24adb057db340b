"""`dlm` records a trace by default; `dlm-trace` show/replay/verify (--rerun)/diff/html on it."""
import hashlib
import json
import os
import shutil

import pytest

from conftest import run_dlm

pytestmark = pytest.mark.slow     # starts processes (see pyproject.toml's markers)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PROMPTS = "prompts=['347+085=',hi,'name a fruit:']"


def _checkpoint(directory):
    """A tiny random LLaDA-format checkpoint (safetensors + config.json) with the char tokenizer."""
    import torch
    from safetensors.torch import save_file

    from dlm_engine.models.loader import build_random
    from dlm_engine.models.tokenizer import save_char_tokenizer

    from dlm_engine.app.config import model_preset

    mc = model_preset("tiny_random")
    model, raw, _ = build_random(dict(mc.random), seed=1)
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw, f)
    save_char_tokenizer(directory)
    return torch


def trace_cli(*args):
    from dlm_engine.trace.cli import main

    return main(list(args))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    ck = base / "ck"
    _checkpoint(ck)
    out = base / "run"
    proc = run_dlm([f"hydra.run.dir={out}", "model=local", f"model.path={ck}", PROMPTS, "batch_size=2", "seed=5",
                    "device=cpu", "gen_length=16", "strategy.temperature=0.8", "strategy.block_length=8",
                    "trace.capture=confidence"], cwd=base)
    assert proc.returncode == 0, proc.stderr
    return base, ck, out


def test_run_writes_trace_named_in_summary(run):
    _, _, out = run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trace"] == "trace.dlmt"
    data = (out / "trace.dlmt").read_bytes()
    assert summary["trace_digest"] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert not (out / "trace.dlmt.partial").exists()


def test_the_header_is_at_most_2_kb(run):
    """The provenance header (a zstd frame of JSON) stays small: the seeded generator state is recorded by its
    seed, and ``verify --rerun`` (below) still reproduces this sampled decode from it."""
    from dlm_engine.trace import format as fmt
    from dlm_engine.trace import open_trace

    _, _, out = run
    tr = open_trace(str(out / "trace.dlmt"))
    assert fmt.REC_HEAD.size + len(tr.records[0].payload) <= 2048
    assert tr.header["rng"]["torch_cpu_seed"] == 5 and "torch_cpu_b64" not in tr.header["rng"]


def test_replay_json_matches_results_in_order(run, capsys):
    _, ck, out = run
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    # ck's tokenizer is byte-identical to the embedded one (same digest): text without naming a directory
    assert trace_cli("replay", str(out / "trace.dlmt"), "--json") == 0
    cap = capsys.readouterr()
    assert not cap.err
    assert [r["text"] for r in json.loads(cap.out)] == [r["text"] for r in rows]
    assert trace_cli("replay", str(out / "trace.dlmt"), "--json", "--tokenizer", str(ck)) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in rep] == [r["tokens"] for r in rows]
    assert [r["text"] for r in rep] == [r["text"] for r in rows]
    assert [r["step_of"] for r in rep] == [r["step_of"] for r in rows]
    assert trace_cli("replay", str(out / "trace.dlmt"), "--step", "2", "--json") == 0
    at2 = json.loads(capsys.readouterr().out)
    assert all(sum(t == 3 for t in r["tokens"]) == r["masked"] for r in at2)
    assert trace_cli("replay", str(out / "trace.dlmt"), "--step", "2") == 0
    assert "step 2:" in capsys.readouterr().out


def test_header_tokenizer_path_is_never_followed(run, tmp_path):
    """A tokenizer the installation does not ship is used only from a directory the user names."""
    from dlm_engine.trace.text import HFText, text_decoder

    _, ck, _ = run
    notes = []
    spec = {"kind": "hf", "path": str(ck), "digest": "sha256:" + "0" * 64}
    assert text_decoder(spec, None, notes) is None
    assert len(notes) == 1 and "--tokenizer DIR" in notes[0] and str(ck) in notes[0]
    notes = []
    dec = text_decoder(spec, ck, notes)
    assert isinstance(dec, HFText) and dec.decode([45, 46]) == "HI" and "differs" in notes[0]


def test_show_html_and_diff(run, capsys, tmp_path):
    base, _, out = run
    t = str(out / "trace.dlmt")
    assert trace_cli("show", t) == 0
    text = capsys.readouterr().out
    assert "weights sha256:" in text and "low_confidence" in text and "wall ms" in text
    html = tmp_path / "v.html"
    assert trace_cli("html", t, "-o", str(html)) == 0
    page = html.read_text()
    assert "<input id=\"t\" type=\"range\"" in page and "const D = " in page and "http" not in page.split("<script>")[1]
    data = json.loads(page.split("const D = ")[1].split(";\nconst T")[0])
    from dlm_engine.trace import open_trace

    tr = open_trace(t)
    assert [x["tok"] for x in data["seqs"]] == [s.tokens.tolist() for s in tr]
    assert [x["so"] for x in data["seqs"]] == [s.step_of.tolist() for s in tr]
    assert data["tmax"] == max(s.n_steps for s in tr) and all(x["conf"] is not None for x in data["seqs"])
    assert trace_cli("diff", t, t) == 0
    assert "no divergence" in capsys.readouterr().out


def test_verify_rerun_reproduces_then_detects_changed_weight(run, capsys, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    base, ck, out = run
    t = str(out / "trace.dlmt")
    assert trace_cli("verify", t) == 0
    assert "intact:" in capsys.readouterr().out
    # the checkpoint path recorded in the header is not followed on its own: the user names it
    assert trace_cli("verify", t, "--rerun") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model-path" in err[0] and str(ck) in err[0]
    assert trace_cli("verify", t, "--rerun", "--model-path", str(ck)) == 0
    assert "reproduced" in capsys.readouterr().out
    # change one weight tensor deliberately
    ck2 = tmp_path / "ck2"
    shutil.copytree(ck, ck2)
    w = load_file(str(ck2 / "model.safetensors"))
    key = "model.transformer.wte.weight"
    g = torch.Generator().manual_seed(0)
    w[key] = w[key] + 0.5 * torch.randn(w[key].shape, generator=g)
    save_file(w, str(ck2 / "model.safetensors"))
    assert trace_cli("verify", t, "--rerun", "--model-path", str(ck2)) == 1
    res = capsys.readouterr().out
    assert "weights digest differs" in res
    assert "diverged: first at row" in res and "step" in res and "position" in res


def test_damaged_files_give_one_line_and_nonzero_exit(run, tmp_path, capsys):
    _, _, out = run
    data = (out / "trace.dlmt").read_bytes()
    cases = {"corrupt": data[:300] + bytes([data[300] ^ 0x40]) + data[301:], "truncated": data[:len(data) - 150],
             "version": data[:8] + b"\x07\x00" + data[10:], "magic": b"hello world, not a trace at all"}
    for name, blob in cases.items():
        p = tmp_path / f"{name}.dlmt"
        p.write_bytes(blob)
        for cmd in (["show"], ["replay", "--json"], ["html", "-o", str(tmp_path / "x.html")]):
            assert trace_cli(cmd[0], str(p), *cmd[1:]) == 2, (name, cmd)
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("dlm-trace: error:"), (name, err)
        assert trace_cli("verify", str(p)) != 0
        capsys.readouterr()
    # --recover reads what is complete and says what was lost
    assert trace_cli("replay", str(tmp_path / "truncated.dlmt"), "--recover") == 0
    cap = capsys.readouterr()
    assert "recovered" in cap.err


READ_CHILD = r"""
import contextlib, io, json, sys
from dlm_engine.trace.cli import main
t = sys.argv[1]
codes = []
with contextlib.redirect_stdout(io.StringIO()):
    for cmd in (["show", t], ["replay", t, "--step", "2"], ["replay", t, "--json"], ["diff", t, t],
                ["html", t, "-o", sys.argv[2]], ["verify", t]):
        codes.append(main(cmd))
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
print(json.dumps({"codes": codes, "peak_kb": peak, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def test_read_commands_import_neither_torch_nor_transformers(run, tmp_path):
    """show/replay/diff/html/verify: numpy + zstandard only, no warnings, well under 200 MB for a small trace."""
    import subprocess
    import sys

    _, _, out = run
    proc = subprocess.run([sys.executable, "-c", READ_CHILD, str(out / "trace.dlmt"), str(tmp_path / "v.html")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["codes"] == [0, 0, 0, 0, 0, 0] and rep["heavy"] == []
    assert proc.stderr == ""                       # no transformers warning, no note
    assert rep["peak_kb"] < 200 * 1024


def test_bad_options_and_outputs_are_one_line(run, tmp_path, capsys):
    _, _, out = run
    t = str(out / "trace.dlmt")
    cases = [(["replay", t, "--step", "-3"], "--step -3 is out of range"),
             (["replay", t, "--step", "999"], "--step 999 is out of range"),
             (["show", t, "--seq", "999"], "--seq 999 is out of range: the trace has 3 sequences (valid: 0..2)"),
             (["show", t, "--seq", "-1"], "--seq -1 is out of range"),
             (["show", t, "--max", "-2"], "--max -2 is out of range"),
             (["html", t, "-o", str(tmp_path)], "is a directory"),
             (["html", t, "-o", str(tmp_path / "missing" / "x.html")], "does not exist"),
             (["show", str(tmp_path)], "is a directory"),
             (["show", t, "--tokenizer", str(tmp_path / "nope")], "--tokenizer"),
             (["verify", t, "--rerun", "--model-path", str(tmp_path / "nope")], str(tmp_path / "nope"))]
    for cmd, needle in cases:
        assert trace_cli(*cmd) == 2, cmd
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dlm-trace: error:") and needle in err[0], (cmd, err)
    assert not (tmp_path / "missing").exists()
    assert trace_cli("replay", t, "--step", "0") == 0 and "step 0:" in capsys.readouterr().out


def test_record_false_writes_no_trace(tmp_path):
    out = tmp_path / "run"
    proc = run_dlm([f"hydra.run.dir={out}", "device=cpu", "trace.record=false", "prompts=[hi]"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not list(out.glob("*.dlmt*"))
    assert "trace" not in json.loads((out / "summary.json").read_text())


def test_bad_trace_config_names_the_key(tmp_path):
    proc = run_dlm([f"hydra.run.dir={tmp_path / 'r'}", "device=cpu", "trace.capture=everything"], cwd=tmp_path)
    assert proc.returncode == 2 and "trace.capture=everything" in proc.stderr


def test_ctrl_c_keeps_a_flushed_partial_trace(tmp_path):
    import signal
    import subprocess
    import time

    from conftest import BIN
    from dlm_engine.trace import open_trace
    from dlm_engine.trace.format import TraceError

    out = tmp_path / "run"
    n = 200  # several times more than can finish before the interrupt lands
    prompts = "prompts=[" + ",".join(f"p{i}" for i in range(n)) + "]"
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    # A shell starts background jobs with SIGINT ignored, and an ignored SIGINT is inherited (Python then keeps
    # it ignored): give the child the default disposition, as a terminal's Ctrl-C would find it.
    proc = subprocess.Popen([str(BIN / "dlm"), f"hydra.run.dir={out}", "device=cpu", prompts, "batch_size=1",
                             "gen_length=48"], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    partial = out / "trace.dlmt.partial"
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            try:
                if partial.exists() and len(open_trace(partial)) >= 2:
                    break
            except TraceError:      # (made, its preamble not written yet: the writer thread is that far)
                pass
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "partial trace kept" in err and not (out / "trace.dlmt").exists()
    tr = open_trace(partial)
    assert tr.status == "interrupted" and 2 <= len(tr) < n
    assert any("lost" in p for p in tr.problems)
    assert [s.row for s in tr] == list(range(len(tr)))
