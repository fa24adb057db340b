"""Monte-Carlo ELBO log-likelihood (dlm_engine.integrations.likelihood) and lm-eval's loglikelihood through the adapter:
exact for one token, unbiased against the enumerated expectation, correct on Dream's shifted logits, and
multiple-choice accuracy on the embedded model through simple_evaluate."""
import itertools
import math

import pytest
import torch
from conftest import need, write_lm_eval_task

from dlm_engine.errors import ConfigError, UserError
from dlm_engine.integrations.likelihood import greedy_matches, mc_loglikelihood


@pytest.fixture(scope="module")
def tiny():
    from dlm_engine.app.api import load_directory

    return load_directory()


def _logp_masked(lm, ctx, target, subset):
    """log p(target_i | ctx, target with `subset` masked) for i in subset, by a plain full forward."""
    ids = torch.tensor([ctx + [lm.mask_id if j in subset else t for j, t in enumerate(target)]])
    with torch.inference_mode():
        logits = lm.model(ids).logits[0, len(ctx):].double()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[i, target[i]]) for i in subset]


def test_one_token_is_exact(tiny):
    ctx, target = tiny.encode("name a fruit:"), tiny.encode("k")
    want = _logp_masked(tiny, ctx, target, {0})[0]
    for seed in (0, 1):
        got = mc_loglikelihood(tiny, ctx, target, samples=5, batch_size=2, generator=torch.Generator().manual_seed(seed))
        assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.slow
def test_estimate_is_unbiased_against_the_enumerated_expectation(tiny):
    """E_l E_S[(L/l) sum_{i in S} log p(y_i | masked S)] over l ~ U{1..L}, S a uniform l-subset, enumerated."""
    ctx, target = tiny.encode("347+085="), tiny.encode("0432")
    L = len(target)
    per_l, values = [], []
    for n in range(1, L + 1):
        terms = [(L / n) * sum(_logp_masked(tiny, ctx, target, set(s))) for s in itertools.combinations(range(L), n)]
        per_l.append(sum(terms) / len(terms))
        values += [(v, 1 / (L * len(terms))) for v in terms]
    exact = sum(per_l) / L
    sd = math.sqrt(sum(w * (v - exact) ** 2 for v, w in values))
    samples = 4000
    got = mc_loglikelihood(tiny, ctx, target, samples=samples, batch_size=500, generator=torch.Generator().manual_seed(0))
    assert abs(got - exact) < 4 * sd / math.sqrt(samples), (got, exact, sd)
    # the terms really differ by subset here, so a wrong weighting or masking would be far off
    assert sd > 1.0
    again = mc_loglikelihood(tiny, ctx, target, samples=samples, batch_size=128, generator=torch.Generator().manual_seed(0))
    assert again == pytest.approx(got, abs=1e-5)  # same masks whatever the batch size (float32 forwards)


def test_the_right_answer_is_most_likely_and_greedy_in_the_trained_layout(tiny):
    ctx = tiny.encode("347+085=")
    eos = [tiny.eos_id] * 12
    scores = {a: mc_loglikelihood(tiny, ctx, tiny.encode(a) + eos, 64, 32, torch.Generator().manual_seed(0))
              for a in ("0432", "0433", "1432", "9999")}
    assert max(scores, key=scores.get) == "0432" and scores["0432"] > -0.5
    assert greedy_matches(tiny, [ctx, ctx], [tiny.encode("0432") + eos, tiny.encode("0433") + eos]) == [True, False]


def test_dream_shifted_logits_are_scored_at_the_right_positions(tmp_path):
    """Dream predicts token i from position i-1; the model shifts internally, so logits_range columns are
    canvas positions. One token: the estimate equals the full forward's log-probability at that column."""
    from official_ckpt import build_dream_instruct

    from dlm_engine.app.api import load_directory

    build_dream_instruct(tmp_path / "dream")
    lm = load_directory(str(tmp_path / "dream"), name="local")
    assert not lm.chat_template
    ctx, target = lm.encode("hello"), lm.encode("w")
    want = _logp_masked(lm, ctx, target, {0})[0]
    assert mc_loglikelihood(lm, ctx, target, 3, 3, torch.Generator().manual_seed(0)) == pytest.approx(want, abs=1e-5)


def test_bad_settings_are_one_line_errors(tiny):
    with pytest.raises(UserError, match="mc_samples=0"):
        mc_loglikelihood(tiny, [5], [6], samples=0)
    with pytest.raises(UserError, match="empty context"):
        mc_loglikelihood(tiny, [], [6])
    assert mc_loglikelihood(tiny, [5], []) == 0.0


MC_DOCS = [{"q": "347+085=", "choices": ["0433", "0432", "1432"], "gold": 1},
           {"q": "901-256=", "choices": ["645", "646", "545"], "gold": 0},
           {"q": "120+333=", "choices": ["0543", "0452", "0453"], "gold": 2}]


@pytest.fixture(scope="module")
def mc_task(tmp_path_factory):
    return write_lm_eval_task(tmp_path_factory.mktemp("lm_eval_mc"), "dlm_mc", MC_DOCS, """output_type: multiple_choice
doc_to_text: "{{q}}"
doc_to_choice: "{{choices}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


@pytest.mark.slow
def test_lm_eval_multiple_choice_through_the_adapter(mc_task, monkeypatch):
    need("lm_eval", "eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import dlm_engine.integrations.lm_eval  # noqa: F401  (registers the model name even without the start-up hook)

    res = simple_evaluate(model="dlm_engine", model_args="mc_samples=32,mc_eos_pad=true,trace.record=false,device=cpu",
                          tasks=["dlm_mc"], task_manager=TaskManager(include_path=str(mc_task)), log_samples=True)
    assert res["results"]["dlm_mc"]["acc,none"] == 1.0
    for s in res["samples"]["dlm_mc"]:
        ll = [r[0][0] for r in s["resps"]]
        greedy = [r[0][1] for r in s["resps"]]
        gold = s["doc"]["gold"]
        assert ll.index(max(ll)) == gold
        assert greedy[gold] and not any(g for i, g in enumerate(greedy) if i != gold)


def test_adapter_options_are_checked():
    need("lm_eval", "eval")
    import dlm_engine.integrations.lm_eval as adapter

    with pytest.raises(ConfigError, match="mc_samples=0"):
        adapter.DLMEngineLM(model="tiny_random", mc_samples=0)
    with pytest.raises(ConfigError, match="greedy_check=maybe"):
        adapter.DLMEngineLM(model="tiny_random", greedy_check="maybe")
