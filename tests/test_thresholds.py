"""Threshold-like options are validated against the range of the confidence kind they are compared with
(docs/thresholds.md): PC-Sampler's debiased scores reach ``clip_alpha`` (a threshold above 1 is right there), an
entropy confidence is <= 0, a uniform draw stays below 1, probabilities and margins lie in [0, 1]; a value the
kind can never reach (or always passes) is one ConfigError line that says so."""
import copy
import json

import pytest

from conftest import FIXTURES
from dlm_engine.core.confidence import sampler_confidence
from dlm_engine.core.loop import Sink
from dlm_engine.core.registry import load_plugins, strategy_class
from dlm_engine.errors import ConfigError

load_plugins()
D2C = FIXTURES / "d2cparity"


def make(name, **kw):
    cls = strategy_class(name)
    return cls(cls.Config(**kw), 32)


@pytest.mark.parametrize("name, kw", [
    ("d2c", dict(debias=True, threshold=3.0)),                                 # PC-Sampler: (0, clip_alpha = 10]
    ("d2c", dict(debias=True, threshold=10.0)),
    ("d2c", dict(debias=True, clip_alpha=4, threshold=4.0)),
    ("d2c", dict(debias=True, threshold=2.5, alg="topk_margin", debias_after_alg=True)),
    ("d2c", dict(debias=True, threshold=3.0, sigma=10.0)),                     # the prior keeps the bound
    ("klass", dict(debias=True, threshold=3.0)),
    ("ar", dict(debias=True, threshold=3.0)),                                  # AR: clip_alpha fixed at 10
    ("d2c", dict(alg="entropy", threshold=-0.5)),                              # entropy: <= 0
    ("d2c", dict(alg="entropy", threshold=0.0)),
    ("d2c", dict(alg="random", threshold=0.99)),
    ("wino", dict(alg="entropy", wide_in_thres=-1.0)),                         # wide-in: the alg's kind
    ("early_exit", dict(early_threshold=1e9, mid_threshold=1e9, late_threshold=1e9)),   # a logit gap: unbounded
])
def test_thresholds_inside_the_kind_are_accepted(name, kw):
    make(name, **kw)


@pytest.mark.parametrize("name, kw, message", [
    ("d2c", dict(threshold=3.0),
     "strategy.threshold=3.0 is impossible for probability confidences (strategy.alg=prob), which never "
     "exceed 1: no position would ever pass it; use a value in (0, 1]"),
    ("d2c", dict(debias=True, clip_alpha=2, threshold=3.0),
     "strategy.threshold=3.0 is impossible for PC-Sampler's debiased confidences (strategy.alg=prob, "
     "strategy.debias=true, clipped at strategy.clip_alpha=2), which never exceed 2: no position would ever pass "
     "it; use a value in (0, 2]"),
    ("ar", dict(debias=True, threshold=12.0), "which never exceed 10"),
    ("d2c", dict(debias=True, threshold=0.0), "strategy.threshold=0.0 is outside (0, 10] for PC-Sampler's debiased "
                                              "confidences"),
    ("d2c", dict(debias=True, threshold=3.0, alg="topk_margin"),     # the alg overwrites the debiased value
     "impossible for top-1 minus top-2 probability margins (strategy.alg=margin, which replaces PC-Sampler's "
     "debiased value unless strategy.debias_after_alg=true)"),
    ("d2c", dict(alg="entropy", threshold=0.5), "impossible for entropy confidences sum p ln p (strategy.alg=entropy), "
                                                "which never exceed 0"),
    ("d2c", dict(alg="random", threshold=1.0), "which stay below 1: no position would ever pass it; use a value in "
                                               "(0, 1)"),
    ("klass", dict(threshold=1.5), "strategy.threshold=1.5 is impossible for probability confidences"),
    ("wino", dict(alg="entropy", wide_in_thres=0.7), "strategy.wide_in_thres=0.7 is impossible for entropy"),
    ("wino", dict(narrow_out_thres=1.5), "strategy.narrow_out_thres=1.5 is outside (0, 1]"),
    ("threshold", dict(threshold=1.5), "strategy.threshold=1.5 is impossible for probability confidences"),
    ("cadllm", dict(threshold=0.0), "strategy.threshold=0.0 is outside (0, 1]"),
    ("dream", dict(threshold=2.0), "strategy.threshold=2.0 is impossible for probability confidences"),
    ("block_buffer", dict(block_length=8, accept_threshold=1.5), "strategy.accept_threshold=1.5 is impossible"),
    ("early_exit", dict(mid_threshold=-1.0), "strategy.mid_threshold=-1.0 is outside [0, inf) for the answer "
                                             "window's mean top-1 minus top-2 logit gap: it is below any gap"),
])
def test_impossible_thresholds_say_why_in_one_line(name, kw, message):
    with pytest.raises(ConfigError) as exc:
        make(name, **kw)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_the_kind_follows_the_options():
    assert sampler_confidence().high == 1.0
    assert sampler_confidence(debias=True).high == 10.0
    assert sampler_confidence(debias=True, clip_alpha=3.5).high == 3.5
    assert sampler_confidence("topk_margin", debias=True).high == 1.0                       # quirk 8
    assert sampler_confidence("topk_margin", debias=True, debias_after_alg=True).high == 10.0
    assert sampler_confidence("entropy", debias=True, debias_after_alg=True).high == 0.0
    assert make("d2c", debias=True).confidence_kind.high == 10.0


class Steps(Sink):
    def __init__(self):
        self.deltas = []

    def on_delta(self, delta, canvas):
        if delta.step > 0:
            self.deltas.append((delta.commit.clone(), delta.confidence.clone()))


def test_pc_sampler_threshold_above_one_commits_by_the_debiased_scores(parity, tiny_llada):
    """A d2c_pc fixture case with threshold 3.0 (the held-back kind): it runs, and every step commits exactly the
    block's masked positions whose debiased confidence is >= 3 (the top num_transfer_tokens when none is)."""
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode

    suite = json.loads((D2C / "d2c_pc.json").read_text())
    case = copy.deepcopy(next(c for c in suite["cases"] if c["id"].startswith("d2c_pc/llada/") and c["seed"] is None))
    case["kwargs"]["threshold"] = 3.0
    strategy, cache, st = parity.build(case, suite)
    rows, _ = parity._rows(case, suite["prompts"])
    canvas = Canvas.from_prompts(rows, st.gen_length, 1000, 1001)
    log = Steps()
    decode(tiny_llada, canvas, strategy, cache=cache, sinks=[log])
    masked = canvas.step_of.new_ones(canvas.gen_length, dtype=bool)
    above_one = multi = 0
    bl = strategy.block_len
    for commit, conf in log.deltas:
        commit, conf = commit[0], conf[0]
        block = int(commit.nonzero()[0]) // bl
        cand = masked.clone()
        cand[:block * bl] = False
        cand[(block + 1) * bl:] = False
        passing = cand & (conf >= 3.0)
        if int(passing.sum()) >= 1:
            assert commit.equal(passing)
        else:
            assert int(commit.sum()) == 1 and float(conf[commit]) == float(conf[cand].max())
        above_one += int((conf[cand] > 1).sum())
        multi += int(commit.sum()) > 1
        masked &= ~commit
    assert not masked.any() and above_one and multi           # scores above 1 were compared; some steps took many
    assert canvas.nfe < case["nfe"]                           # fewer calls than the fixed rate of the fixture case
