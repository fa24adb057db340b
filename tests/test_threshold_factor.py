"""threshold and factor strategies: selection rules, loop control, deltas, batching, caches, validation."""
import pytest
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.errors import ConfigError
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import cache_class, strategy_class
from dlm_engine.core.selection import factor_commit, threshold_commit
from dlm_engine.app.sinks import RecordingSink

PROMPTS = [[735, 559, 771, 678, 375, 377], [127, 157, 983, 804, 991, 537, 902, 490, 136, 103, 962], [413, 750, 0]]


def _factor_per_row(conf_row, cand_row, f):
    """The reference's per-row loop, written out literally (rank scan with the last-rank exception)."""
    c = conf_row[cand_row]
    M = len(c)
    srt = torch.sort(c, descending=True).values
    thresh = [-1.0] + [1 - f / (n + 1) for n in range(2, M + 1)]
    i = 0
    for i in range(M):
        if srt[i] < thresh[i]:
            break
    if i == 0 or i == M - 1:
        i += 1
    out = torch.zeros_like(cand_row)
    masked = torch.where(cand_row, conf_row, torch.full_like(conf_row, float("-inf")))
    out[torch.topk(masked, i).indices] = True
    return out


@pytest.mark.parametrize("f", [0.3, 1.0, 2.0, 5.0])
def test_factor_commit_equals_the_reference_loop_on_random_batches(f):
    g = torch.Generator().manual_seed(int(f * 10))
    for _ in range(40):
        conf = torch.rand(4, 12, generator=g, dtype=torch.float64) ** 0.3   # many confident entries
        cand = torch.rand(4, 12, generator=g) < 0.7
        cand[:, 0] = True
        got = factor_commit(conf, cand, f)
        for r in range(4):
            assert torch.equal(got[r], _factor_per_row(conf[r], cand[r], f)), (conf[r], cand[r])


def test_factor_last_rank_failure_commits_everything():
    conf = torch.tensor([[0.99, 0.95, 0.10]], dtype=torch.float64)   # rank 3 fails (0.1 < 1 - 1/4)
    cand = torch.ones_like(conf, dtype=torch.bool)
    assert factor_commit(conf, cand, 1.0).all()
    conf4 = torch.tensor([[0.99, 0.95, 0.10, 0.05]], dtype=torch.float64)  # rank 3 of 4 fails -> 2
    assert factor_commit(conf4, torch.ones_like(conf4, dtype=torch.bool), 1.0).sum() == 2


def test_threshold_commit_is_top1_plus_everything_above():
    conf = torch.tensor([[0.2, 0.95, 0.9, 0.3], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    cand = torch.tensor([[True, True, True, True], [True, True, False, False]])
    got = threshold_commit(conf, cand, 0.9)
    assert got.tolist() == [[False, True, True, False], [False, True, False, False]]


def _run(model, name, prompts, gen=16, cache="none", seed=None, **kw):
    cls = strategy_class(name)
    canvas = Canvas.from_prompts(prompts, gen, 1000, 1001)
    rec = RecordingSink()
    if seed is not None:
        torch.manual_seed(seed)
    decode(model, canvas, cls(cls.Config(**kw), gen), cache=cache_class(cache)(cache_class(cache).Config()),
           sinks=[rec])
    return canvas, rec


@pytest.mark.parametrize("name, kw", [("threshold", dict(threshold=0.7)), ("factor", dict(factor=1.5))])
def test_deltas_report_commits_per_row_and_blocks_end_when_full(tiny_llada, name, kw):
    canvas, rec = _run(tiny_llada, name, PROMPTS[:1], block_length=8, **kw)
    assert not canvas.masked().any()
    assert canvas.nfe == len(rec.deltas) < 16                    # parallel: fewer forwards than tokens
    for d in rec.deltas:
        c = d.scalars["committed"]
        assert torch.is_tensor(c) and c.shape == (1,) and int(c[0]) == int(d.commit.sum()) >= 1
    kinds = [(e.kind, e.block) for d in rec.deltas for e in d.block_events]
    assert kinds == [("opened", 0), ("completed", 0), ("opened", 1), ("completed", 1)]
    # the block ends on the step that fills it: no forward without a commit
    assert all(int(d.commit.sum()) > 0 for d in rec.deltas)


def test_threshold_one_commits_one_token_per_step(tiny_llada):
    canvas, rec = _run(tiny_llada, "threshold", PROMPTS[:1], threshold=1.0)
    assert canvas.nfe == 16 and all(int(d.commit.sum()) == 1 for d in rec.deltas)


@pytest.mark.parametrize("name, kw", [("threshold", dict(threshold=0.6, block_length=4)),
                                      ("factor", dict(factor=2.0, block_length=8))])
def test_batched_rows_equal_rows_alone(tiny_llada, name, kw):
    canvas, rec = _run(tiny_llada, name, PROMPTS, **kw)
    g = canvas.gen_start
    assert canvas.is_padded and not canvas.masked().any()
    assert rec.deltas[0].scalars["committed"].shape == (3,)
    for r, p in enumerate(PROMPTS):
        alone, _ = _run(tiny_llada, name, [p], **kw)
        assert torch.equal(canvas.tokens[r, g:], alone.tokens[0, alone.gen_start:])


def test_temperature_draws_are_reproducible(tiny_llada):
    a, _ = _run(tiny_llada, "threshold", PROMPTS[:1], seed=3, temperature=0.8, threshold=0.8, block_length=8)
    b, _ = _run(tiny_llada, "threshold", PROMPTS[:1], seed=3, temperature=0.8, threshold=0.8, block_length=8)
    c, _ = _run(tiny_llada, "threshold", PROMPTS[:1], seed=4, temperature=0.8, threshold=0.8, block_length=8)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_plans_carry_block_directives_so_caches_work(tiny_llada, cache):
    canvas, rec = _run(tiny_llada, "threshold", PROMPTS[:1], cache=cache, threshold=0.9, block_length=8)
    assert not canvas.masked().any() and canvas.nfe == len(rec.deltas)


@pytest.mark.parametrize("name, kw, key", [
    ("threshold", dict(threshold=0.0), "strategy.threshold=0.0"),
    ("threshold", dict(threshold=1.5), "strategy.threshold=1.5"),
    ("threshold", dict(steps=3, block_length=8), "strategy.steps=3"),
    ("factor", dict(factor=0.0), "strategy.factor=0.0"),
    ("factor", dict(factor=-1.0), "strategy.factor=-1.0"),
    ("factor", dict(block_length=5), "strategy.block_length=5"),
    ("factor", dict(remasking="maybe"), "strategy.remasking"),
])
def test_bad_values_name_the_key(name, kw, key):
    cls = strategy_class(name)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        cls(cls.Config(**kw), 16)


def test_defaults_are_the_reference_defaults():
    t = strategy_class("threshold").Config()
    assert (t.threshold, t.block_length, t.steps, t.temperature, t.remasking) == (0.9, None, None, 0.0, "low_confidence")
    assert strategy_class("factor").Config().factor == 1.0
