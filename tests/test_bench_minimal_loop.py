"""experiments/bench_minimal_loop.py: its bare loops make dlm_engine's tokens, or the comparison refuses to report.

The figures are machine-dependent and not tested; what is tested is that the framework-free loops decode exactly
what the engine decodes (so the comparison is of the same work), in one block and in several, and that a loop that
decodes something else is caught.
"""
import pytest

from conftest import load_experiment


@pytest.fixture(scope="module")
def bench():
    return load_experiment("bench_minimal_loop")


@pytest.fixture(scope="module")
def tiny(bench):
    label, model, gen, block, prompts, budget = bench.bench_overhead.models("tiny")[0]
    return model, gen, block, prompts[:3]


@pytest.mark.parametrize("name", ["threshold", "low_confidence"])
@pytest.mark.parametrize("blocks", [1, 2])
def test_the_bare_loops_make_the_engines_tokens(bench, tiny, name, blocks):
    model, gen, block, prompts = tiny
    mini, eng = bench.compare(model, prompts, gen, gen // blocks, name, repeats=1)
    assert mini[2] == eng[2] > 0                     # the same steps (compare also checked every token)
    assert mini[0] > 0 and eng[0] > 0 and mini[1] > 0 and eng[1] > 0


def test_a_bare_loop_that_decodes_otherwise_is_refused(bench, tiny, monkeypatch):
    model, gen, block, prompts = tiny
    real = bench.minimal_threshold
    monkeypatch.setitem(bench.LOOPS, "threshold", lambda *a: real(*a, tau=1.01))   # top-1 only: more steps
    with pytest.raises(AssertionError, match="other tokens or steps"):
        bench.compare(model, prompts, gen, block, "threshold", repeats=1)


def test_main_prints_both_loops_and_their_ratio(bench, capsys):
    assert bench.main(["--model", "tiny", "--prompts", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("threshold", "low_confidence"):
        assert f"{name:<16}minimal" in out and f"{name:<16}dlm_engine" in out
    assert out.count("(same tokens and steps)") == 2
    assert "ops/step" in out


def test_ops_are_counted_the_same_way_for_both_loops(bench, tiny):
    """The operation counts compare like with like: the engine's is bench_overhead's own count, and the bare loop's
    counter sees its operations (a loop of at least argmax, softmax, where and a commit a step)."""
    model, gen, block, prompts = tiny
    mini, eng = bench.ops_per_step(model, prompts, gen, block, "low_confidence")
    res = bench.bench_overhead.one(model, prompts, gen, "low_confidence", {"block_length": block}, "none", 1,
                                   instrument=("syncs",))
    assert eng == res[6] / res[2]
    assert mini >= 4
