"""Issue 45 item 6: the Python API and the trace on the block-diffusion families -- runs of every new family and
strategy (fdv2, fdv2_batch, sdar, llada2, edit, and an existing strategy on LLaDA2) record, replay, verify (with a
rerun), diff and render; the tiny official-format checkpoints have no tokenizer, so prompts are token ids."""
import json

import pytest

import dlm_engine
from conftest import FIXTURES
from dlm_engine.trace import open_trace
from dlm_engine.trace.cli import main

BD = FIXTURES / "bdparity"


def trace_cli(*args):
    return main(list(args))

PROMPTS = [[40, 41, 42, 43, 44], [50, 51, 52]]
RUNS = [  # (family dir, strategy, cache, options)
    ("tiny_fdv2", "fdv2", "block_kv", {}),
    ("tiny_fdv2", "fdv2_batch", "none", {}),
    ("tiny_sdar", "sdar", "block_kv", {"strategy.block_length": 4}),
    ("tiny_llada2", "llada2", "block_store", {}),
    ("tiny_llada21", "edit", "none", {}),
    ("tiny_llada2", "threshold", "prefix", {"strategy.block_length": 32}),
    ("tiny_sdar", "low_confidence", "none", {"strategy.block_length": 4, "strategy.steps": 32}),
]


def session(family):
    return dlm_engine.Session(model="local", device="cpu", dtype="float32", **{"model.path": str(BD / family)})


@pytest.mark.slow   # 7 cases, ~8 s (record, replay, verify --rerun, diff, html each): in-process but kept out of the quick tier (CI runs it)
@pytest.mark.parametrize("family,strategy,cache,opts", RUNS, ids=[f"{f}-{s}" for f, s, _, _ in RUNS])
def test_trace_records_replays_verifies_diffs_and_renders(family, strategy, cache, opts, tmp_path, capsys):
    path = tmp_path / "run.dlmt"
    res = session(family).generate(PROMPTS, strategy, cache, trace=path, gen_length=32, seed=3, **opts)
    assert res.trace == str(path) and len(res) == 2
    assert all(r.prompt_ids == p for r, p in zip(res, PROMPTS))
    assert all(len(r.tokens) == 32 and r.nfe > 0 for r in res)
    t = str(path)
    # replay without the model: the decoded tokens and commit steps, in order
    assert trace_cli("replay", t, "--json") == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in rep] == [r.tokens for r in res]
    assert [r["step_of"] for r in rep] == [r.step_of for r in res]
    tr = open_trace(t)
    assert [s.tokens.tolist() for s in tr] == [r.tokens for r in res]
    if strategy == "edit":      # LLaDA2.1's edits of decoded tokens are recorded (what a position held before)
        assert any(s.edits is not None and len(s.edits["col"]) for s in tr)
    # integrity, then a rerun with the checkpoint reproduces every step
    assert trace_cli("verify", t) == 0
    assert "intact:" in capsys.readouterr().out
    assert trace_cli("verify", t, "--rerun", "--model-path", str(BD / family)) == 0
    assert "reproduced" in capsys.readouterr().out
    assert trace_cli("diff", t, t) == 0
    assert "no divergence" in capsys.readouterr().out
    html = tmp_path / "v.html"
    assert trace_cli("html", t, "-o", str(html)) == 0
    data = json.loads(html.read_text().split("const D = ")[1].split(";\nconst T")[0])
    assert [x["tok"] for x in data["seqs"]] == [s.tokens.tolist() for s in tr]
    assert [x["so"] for x in data["seqs"]] == [s.step_of.tolist() for s in tr]


def test_diff_finds_where_two_block_diffusion_runs_part(tmp_path, capsys):
    s = session("tiny_sdar")
    a, b = tmp_path / "a.dlmt", tmp_path / "b.dlmt"
    s.generate(PROMPTS, "sdar", "block_kv", trace=a, gen_length=32, **{"strategy.block_length": 4})
    s.generate(PROMPTS, "sdar", "block_kv", trace=b, gen_length=32,
               **{"strategy.block_length": 4, "strategy.threshold": 0.5})
    capsys.readouterr()
    assert trace_cli("diff", str(a), str(b)) == 1
    assert "first" in capsys.readouterr().out


@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_python_api_generate_on_a_local_block_diffusion_checkpoint():
    res = dlm_engine.generate([[40, 41, 42]], "llada2", "block_store", model="local", device="cpu",
                              dtype="float32", gen_length=32, **{"model.path": str(BD / "tiny_llada2")})
    again = dlm_engine.generate([[40, 41, 42]], "llada2", "none", model="local", device="cpu",
                                dtype="float32", gen_length=32, **{"model.path": str(BD / "tiny_llada2")})
    assert res[0].tokens == again[0].tokens       # the block store is exact for the reference decoder
    assert len(res[0].tokens) == 32 and res[0].nfe > 0 and res.metrics
