"""``StepPlan.masked``: strategies that can only commit masked positions say how many the window holds per row
(host numbers), and the sampler computes confidences there only (the float64 softmax over the vocabulary is the
costliest part of a step outside the model). The outputs must be exactly those of scoring every position."""
import pytest
import torch

import dlm_engine.core.sampler as sampler
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.capabilities import incompatibility
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import cache_class, strategy_class
from fakes import CommittedDeltas

CASES = [
    ("low_confidence", {"block_length": 8, "steps": 16}),
    ("low_confidence", {"block_length": 8, "steps": 16, "loop": "fastdllm"}),
    ("threshold", {"block_length": 8, "threshold": 0.7}),
    ("factor", {"block_length": 8}),
    ("early_exit", {"block_length": 8, "steps": 16, "answer_start": 0}),
    ("cadllm", {"initial_block_length": 8, "min_block": 4, "max_block": 8}),
    ("block_buffer", {"block_length": 4, "buffer_size": 3, "add_block_threshold": 0.3}),
    ("low_confidence", {"block_length": 8, "steps": 16, "temperature": 0.7}),
    ("threshold", {"block_length": 8, "threshold": 0.7, "temperature": 0.5}),
    ("block_buffer", {"block_length": 4, "buffer_size": 3, "temperature": 0.6}),
]


def run(model, name, kw, cache, min_saving, monkeypatch):
    monkeypatch.setattr(sampler, "SCORED_MIN_SAVING", min_saving)
    calls = []
    orig = sampler.scored_proposal
    monkeypatch.setattr(sampler, "scored_proposal", lambda *a, **k: calls.append(1) or orig(*a, **k))
    cls = strategy_class(name)
    strategy = cls(cls.Config(**kw), 16)
    cache_cls = cache if isinstance(cache, type) else cache_class(cache)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]][:cls.max_batch or 3]
    canvas = Canvas.from_prompts(prompts, 16, int(model.config.mask_token_id), 0,
                                 eos_id=int(model.config.eos_token_id))
    sink = CommittedDeltas()
    torch.manual_seed(0)                                   # the same draws for both runs (T > 0)
    decode(model, canvas, strategy, cache_cls(), sinks=[sink])
    return (canvas.tokens.tolist(), canvas.step_of.tolist(), canvas.nfe, sink.seen), len(calls)


def _pairs():
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    out = []
    for name, kw in CASES:
        cls = strategy_class(name)
        for cache in ("none", "dual"):
            if incompatibility(cls(cls.Config(**kw), 16), cache_class(cache)()) is None:
                out.append((name, kw, cache))
    return out


@pytest.mark.parametrize("name, kw, cache", _pairs())
def test_scoring_masked_positions_only_changes_nothing(tiny_llada, monkeypatch, name, kw, cache):
    scored, n_scored = run(tiny_llada, name, kw, cache, 0, monkeypatch)              # always the masked path
    full, n_full = run(tiny_llada, name, kw, cache, 1 << 62, monkeypatch)            # never
    assert n_scored > 0 and n_full == 0
    assert scored == full


def test_sums_and_confidence_readers_keep_every_position(tiny_llada, monkeypatch):
    """An entropy confidence (a sum over the vocabulary: it may reduce differently for fewer positions) and a
    cache that reads every position's confidence (``Cache.reads_confidence``) get the whole window scored."""
    class Reading(cache_class("none")):
        reads_confidence = True

    _, n = run(tiny_llada, "low_confidence", {"block_length": 8, "steps": 16, "confidence": "entropy"}, "none", 0,
               monkeypatch)
    assert n == 0
    _, n = run(tiny_llada, "low_confidence", {"block_length": 8, "steps": 16}, Reading, 0, monkeypatch)
    assert n == 0
    _, n = run(tiny_llada, "low_confidence", {"block_length": 8, "steps": 16}, "none", 0, monkeypatch)
    assert n > 0


@pytest.mark.parametrize("kind, dtype, top_v", [("prob", "model", None), ("prob", "float64", None), ("prob", "model", 7),
                                                ("margin", "float64", None), ("inv_entropy", "model", 5),
                                                ("entropy", "float64", None)])
def test_scored_proposal_is_the_whole_windows_at_the_masked_positions(kind, dtype, top_v):
    """At T = 0 the proposals and confidences of the masked positions are made from their logits only: the same
    bits as over the whole window there (ties in the argmax included), the held token and -inf elsewhere."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 40, generator=g) * 3
    logits[0, 2, [4, 11]] = 50.0                           # an exact tie: the first index wins either way
    mask = torch.rand(3, 9, generator=g) < 0.5
    mask[1] = False                                        # a row with nothing masked
    tokens = torch.randint(0, 40, (3, 9), generator=g)
    x0, conf = sampler.scored_proposal(logits, None, kind, dtype, top_v, mask, int(mask.sum()), tokens)
    full_x0 = logits.argmax(-1)
    full = sampler.confidence_of(logits, full_x0, kind, dtype, top_v=top_v)
    assert torch.equal(x0, torch.where(mask, full_x0, tokens)) and x0.dtype == torch.long
    assert torch.equal(conf[mask], full[mask]) and bool((conf[~mask] == float("-inf")).all())
    assert int(x0[0, 2]) == 4 or not bool(mask[0, 2])
    drawn = torch.randint(0, 40, (3, 9), generator=g)     # T > 0: the window's draw is given and kept
    x0, conf = sampler.scored_proposal(logits, drawn, kind, dtype, top_v, mask, int(mask.sum()), tokens)
    full = sampler.confidence_of(logits, drawn, kind, dtype, top_v=top_v)
    assert x0 is drawn and torch.equal(conf[mask], full[mask]) and bool((conf[~mask] == float("-inf")).all())


def test_top_v_confidences_pay_for_scoring_at_fewer_positions_on_a_cpu():
    """CadLLM's top-V pick costs ~8x a softmax per logit on a CPU: leaving out 2 positions of a 4,096 vocabulary
    pays for the gathering there, where a softmax needs 16; on a GPU (launch-bound) the plain count stands."""
    cpu, gpu, V = torch.device("cpu"), torch.device("cuda"), 4096      # (device objects only: nothing runs there)
    assert sampler.scoring_pays_off(16, V, None, cpu) and not sampler.scoring_pays_off(15, V, None, cpu)
    assert sampler.scoring_pays_off(2, V, 100, cpu) and not sampler.scoring_pays_off(1, V, 100, cpu)
    assert sampler.scoring_pays_off(16, V, 100, gpu) and not sampler.scoring_pays_off(15, V, 100, gpu)


def test_the_loop_weighs_the_plans_top_v(tiny_llada, monkeypatch):
    """The step loop asks with the plan's ``top_v``: CadLLM's steps are scored where a softmax's would not be."""
    seen = []
    orig = sampler.scoring_pays_off
    monkeypatch.setattr(sampler, "scoring_pays_off", lambda *a: seen.append(a) or orig(*a))
    V = int(tiny_llada.config.vocab_size)
    # leaving out a single position of the tiny vocabulary pays off with the top-V weight only
    _, n_cad = run(tiny_llada, "cadllm", {"initial_block_length": 8, "min_block": 4, "max_block": 8}, "none",
                   V * sampler.SCORED_WEIGHT_TOP_V, monkeypatch)
    assert seen and all(a[2] is not None for a in seen) and n_cad > 0
    seen.clear()
    _, n_thr = run(tiny_llada, "threshold", {"block_length": 8, "threshold": 0.7}, "none",
                   V * sampler.SCORED_WEIGHT_TOP_V * 64, monkeypatch)
    assert seen and all(a[2] is None for a in seen) and n_thr == 0
