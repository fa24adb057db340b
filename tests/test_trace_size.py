"""Trace bytes per generated position at batch 1 (issue 17): a real run (``dlm``'s own ``run``) of a random model
with a 4,096-token vocabulary at gen 128, default capture, stays within 3.0 bytes per generated position for the
file minus its preamble and header record; a 1,024-position decode within 2.5; the embedded model at gen 128 (run past its
64-position context with ``model.max_length``) within 3.0 and at gen 48 within 5.0.

The step loop's clock is replaced by a deterministic one (7 ms steps, 8% jitter, an occasional 3x stall), so the
byte counts are deterministic; the benchmark (experiments/bench_trace.py) measures real clocks."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from dlm_engine.trace import format as fmt  # noqa: E402
from dlm_engine.trace import open_trace  # noqa: E402

RANDOM_4096 = ["model=tiny_random", "model.random.vocab_size=4096", "model.random.embedding_size=4096",
               "model.random.max_sequence_length=2048"]


@pytest.fixture
def steady_clock(monkeypatch):
    """The step loop's ``time.perf_counter``: 7 ms a step with 8% jitter and a 3x stall one step in 50."""
    import dlm_engine.core.loop as loop

    rng = np.random.default_rng(0)
    now = [0.0]

    def perf_counter():
        now[0] += 0.007 * (1 + 0.08 * rng.standard_normal()) * (3 if rng.random() < 0.02 else 1)
        return now[0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=perf_counter))
    return perf_counter


def body_bytes(path) -> tuple:
    """(bytes of the file minus its preamble and header record, generated positions)."""
    tr = open_trace(path, recover=False)
    assert tr.ok and tr.major == 2
    header = fmt.REC_HEAD.size + len(tr.records[0].payload)
    return tr.size - len(fmt.PREAMBLE) - header, sum(s.gen_length for s in tr)


def dlm_run(tmp_path, overrides):
    from hydra import compose, initialize_config_module

    from dlm_engine.app.config import register_configs
    from dlm_engine.app.run import run
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    register_configs()
    with initialize_config_module(config_module="dlm_engine.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides + ["progress=false"])
    run(cfg, tmp_path)
    return tmp_path / cfg.trace.filename


def test_a_batch_1_gen_128_run_takes_at_most_3_bytes_per_position(tmp_path, steady_clock):
    path = dlm_run(tmp_path, ["batch_size=1", "gen_length=128", "task.n=1"] + RANDOM_4096)
    body, positions = body_bytes(path)
    assert positions == 128
    assert body / positions <= 3.0, f"{body} bytes for {positions} generated positions"
    tr = open_trace(path)
    steps = tr[0].steps                       # the default capture: per-step NFE, wall time, window, scalars
    assert len(steps) == 128 and steps.nfe.tolist() == [1] * 128 and {"block", "committed"} <= set(steps.scalars)
    assert (np.diff(steps.wall_time) > 0).all() and steps.width.min() > 0


def test_the_embedded_model_at_its_longest_canvas(tmp_path, steady_clock):
    """The embedded model declares a 64-position context; at gen 48 the batch's fixed records (batch,
    batch-end: ~160 bytes) weigh 3.4 bytes per position on their own: 4.83 with this clock."""
    path = dlm_run(tmp_path, ["batch_size=1", "gen_length=48", "task.n=1"])
    body, positions = body_bytes(path)
    assert positions == 48 and body / positions <= 5.0, f"{body} bytes for {positions} generated positions"


@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_the_embedded_model_at_gen_128_takes_at_most_3_bytes_per_position(tmp_path, steady_clock):
    """Past its declared context (``model.max_length``): a real decode of 128 positions, whatever it writes."""
    path = dlm_run(tmp_path, ["batch_size=1", "gen_length=128", "model.max_length=192", "task.n=1"])
    body, positions = body_bytes(path)
    assert positions == 128
    assert body / positions <= 3.0, f"{body} bytes for {positions} generated positions"
    assert len(open_trace(path)[0].steps) == 128


def test_a_1024_position_decode_takes_at_most_2_5_bytes_per_position(tmp_path, steady_clock):
    """1,024 steps of one token each, LLaDA-style (32-position blocks, the most confident first), tokens skewed
    over a 4,096-token vocabulary: the recorder fed the deltas a decode would emit."""
    from dlm_engine.core.canvas import BlockEvent, Canvas, FrameDelta
    from dlm_engine.trace import TraceRecorder

    L, V, P, block = 1024, 4096, 12, 32
    rng = np.random.default_rng(1)
    header = {"model": {"eos_id": 2, "mask_id": 3, "vocab_size": V}, "tokenizer": {"kind": "char"},
              "rows_expected": 1, "config": {"strategy": {"name": "low_confidence"}},
              "shape": {"vocab_size": V, "batch_size": 1, "gen_length": L, "prompt_length": P}}
    canvas = Canvas.from_prompts([list(range(10, 10 + P))], L, mask_id=3, pad_id=0)
    tokens = np.minimum(rng.zipf(1.3, L) + 3, V - 1)
    t0 = steady_clock()
    with TraceRecorder(str(tmp_path / "t.dlmt"), header) as rec:
        sink = rec.sink(0, [0])
        sink.on_start(canvas, {"strategy": "low_confidence"})
        step = 0
        for b in range(L // block):
            s, e = P + b * block, P + (b + 1) * block
            for c in rng.permutation(block):
                step += 1
                commit = torch.zeros(1, L + P, dtype=torch.bool)
                commit[0, s + c] = True
                events = ([BlockEvent("opened", b, s, e)] if step % block == 1 else []) + \
                    ([BlockEvent("completed", b, s, e)] if step % block == 0 else [])
                last = step == L
                d = FrameDelta(step=step, nfe=1, start=0, commit=commit,
                               tokens=torch.full((1, L + P), int(tokens[s + c - P])), active=torch.ones(1, dtype=torch.bool),
                               finished=torch.tensor([last]), block_events=events,
                               scalars={"block": b, "committed": commit.sum(-1)}, wall_time=steady_clock() - t0)
                canvas.apply(d)
                sink.on_delta(d, canvas)
        sink.on_end(canvas)
    body, positions = body_bytes(tmp_path / "t.dlmt")
    assert positions == L
    assert body / positions <= 2.5, f"{body} bytes for {positions} generated positions"
    seq = open_trace(tmp_path / "t.dlmt")[0]
    assert np.array_equal(seq.tokens, tokens) and seq.n_steps == L and len(seq.steps) == L
