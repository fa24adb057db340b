"""experiments/bench_writer_process.py: both hand-overs deliver a run's tensors to the child, whole.

The timings are machine-dependent and not tested; what is tested is that the measured hand-overs do the work a
writer process would need (every tensor of every delta, the same bytes either way, all received by the child), and
that bad options are refused.
"""
import pytest

from conftest import load_experiment


@pytest.fixture(scope="module")
def bench():
    return load_experiment("bench_writer_process")


@pytest.fixture(scope="module")
def run(bench):
    cfg, ms, mc, lm, inputs = bench.bench_trace.load_default(["gen_length=16", "batch_size=1", "device=cpu"])
    return cfg, ms, mc, lm, inputs["ids"][:2]


def test_both_handovers_pipe_every_tensor_of_the_run(bench, run):
    cfg, ms, mc, lm, ids = run
    got = {}
    for h in bench.HANDOVERS:
        stat = bench.new_stat()
        assert bench.run_once(h, cfg, ms, mc, lm, ids, stat) > 0     # (raises if the child's count differs)
        got[h] = stat
    # a delta holds at least its commit and tokens for every generated position: 16 positions x 2 prompts
    assert got["step"]["tensor_bytes"] >= 2 * 16 * (1 + 8)
    assert got["step"]["tensor_bytes"] == got["batch"]["tensor_bytes"]       # the batch stacks lose nothing
    assert got["step"]["steps"] == got["batch"]["steps"] > 0
    assert got["batch"]["batches"] == len(ids)                                # batch 1: one send per prompt
    assert got["step"]["sent"] > got["step"]["tensor_bytes"] and got["batch"]["sent"] > got["batch"]["tensor_bytes"]


def test_a_lost_byte_is_caught(bench, run, monkeypatch):
    """The child's count is checked: a hand-over that sends less than it says fails the run."""
    cfg, ms, mc, lm, ids = run
    real = bench.StepHandover.on_delta

    def miscount(self, d, canvas):
        real(self, d, canvas)
        self.stat["sent"] += 1

    monkeypatch.setattr(bench.StepHandover, "on_delta", miscount)
    stat = bench.new_stat()
    with pytest.raises(AssertionError, match="the child got"):
        bench.run_once("step", cfg, ms, mc, lm, ids, stat)


def test_main_prints_each_handover(bench, capsys):
    assert bench.main(["--pairs", "1", "--gen-length", "16"]) == 0
    out = capsys.readouterr().out
    assert " step: wall median pair ratio" in out and "batch: wall median pair ratio" in out
    assert out.count("all received") == 2 and "provenance header" in out


@pytest.mark.parametrize("argv, what", [(["--handover", "thread"], "--handover=thread"),
                                        (["--pairs", "0"], "--pairs=0")])
def test_bad_options_are_refused(bench, capsys, argv, what):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and what in capsys.readouterr().err


def test_a_failed_run_reaps_its_child(bench, run, monkeypatch):
    import subprocess

    import dlm_engine.app.api as api

    cfg, ms, mc, lm, ids = run
    children = []
    real_popen = subprocess.Popen

    def popen(*a, **kw):
        children.append(real_popen(*a, **kw))
        return children[-1]

    def broken(*a, **kw):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    monkeypatch.setattr(api, "run_prompts", broken)
    with pytest.raises(RuntimeError, match="decode failed"):
        bench.run_once("batch", cfg, ms, mc, lm, ids, bench.new_stat())
    assert len(children) == 1 and children[0].returncode == 0     # exited (its pipe closed) and waited for
