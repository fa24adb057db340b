"""EOS policy of low_confidence (docs/specs/strategies.md §2: logits_eos_inf, confidence_eos_eot_inf) and the
early stop at EOS, with a scripted model whose per-column preferences are known."""

import pytest

from dlm_engine.core.canvas import Canvas
from dlm_engine.errors import ConfigError
from dlm_engine.app.api import generated_token_count
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import strategy_class

from fakes import EOS, EOT, MASK, P, Scripted  # noqa: E402


def model():
    # generation: [1, 2, EOS, EOS, EOS, EOS]; EOS at column 2 is the most confident of all
    return Scripted(top=[1, 2, EOS, EOS, EOS, EOS], conf=[0.9, 0.8, 0.99, 0.5, 0.5, 0.5],
                    second=[3, 4, 5, EOT, 6, 6])


def run(m, prompts=([0, 1],), eos=EOS, eot=EOT, **kw):
    cls = strategy_class("low_confidence")
    st = cls(cls.Config(**kw), 6)
    canvas = Canvas.from_prompts([list(p) for p in prompts], 6, MASK, 0, eos_id=eos, eot_id=eot)
    decode(m, canvas, st)
    return canvas


def test_default_commits_eos_like_any_token():
    c = run(model())
    assert c.tokens[0, P:].tolist() == [1, 2, EOS, EOS, EOS, EOS]
    assert c.step_of[0, P + 2] == 1 and c.nfe == 6


def test_logits_eos_inf_never_proposes_eos():
    c = run(model(), logits_eos_inf=True)
    assert EOS not in c.tokens[0, P:].tolist()
    assert c.tokens[0, P:].tolist() == [1, 2, 5, EOT, 6, 6]


def test_confidence_eos_eot_inf_commits_eos_and_eot_last_at_t0():
    c = run(model(), confidence_eos_eot_inf=True)
    assert c.tokens[0, P:].tolist() == [1, 2, EOS, EOS, EOS, EOS]   # EOS is still proposed (quirk)
    so = c.step_of[0, P:].tolist()
    assert so[0] < so[2] and so[1] < so[2]                        # ... but ranked after every other token
    assert sorted(so[:2]) == [1, 2]


def test_stop_at_eos_ends_the_row_and_saves_forwards():
    m = model()
    c = run(m, stop_at_eos=True)
    # step 1 commits the EOS at column 2, steps 2 and 3 the two positions before it: then the row is done
    assert c.nfe == 3 and m.calls == 3 and bool(c.finished.all())
    assert c.tokens[0, P:].tolist() == [1, 2, EOS, EOS, EOS, EOS]
    assert generated_token_count(c.tokens[0, P:].tolist(), EOS) == 3


def test_stop_at_eos_per_row_in_a_batch():
    """Row 0 ends after 3 steps; row 1 (EOS further right) keeps decoding; finished rows stop counting NFE."""
    m = Scripted(top=[[1, 2, EOS, EOS, EOS, EOS], [1, 2, 3, 4, EOS, EOS]],
                 conf=[[0.9, 0.8, 0.99, 0.5, 0.5, 0.5], [0.7, 0.68, 0.66, 0.64, 0.55, 0.5]],
                 second=[[3, 4, 5, EOT, 6, 6], [3, 4, 5, 6, 6, 6]])
    c = run(m, prompts=([0, 1], [0, 1]), stop_at_eos=True)
    assert c.row_nfe.tolist() == [3, 5] and c.nfe == 5 and bool(c.finished.all())
    assert [generated_token_count(r, EOS) for r in c.tokens[:, P:].tolist()] == [3, 5]
    assert c.tokens[1, P:].tolist() == [1, 2, 3, 4, EOS, EOS]


def test_eos_options_need_the_models_ids():
    for key in ("logits_eos_inf", "stop_at_eos", "confidence_eos_eot_inf"):
        with pytest.raises(ConfigError, match=f"strategy.{key}"):
            run(model(), eos=None, eot=None, **{key: True})


def test_ids_come_from_the_model_config(tmp_path):
    """Through the Python API the canvas carries the loaded model's EOS/EoT ids (no hard-coded 126081)."""
    from official_ckpt import build_llada_instruct

    from dlm_engine.app.api import load_model, run_prompts
    from dlm_engine.core.registry import cache_class

    ids = build_llada_instruct(tmp_path / "llada")

    class M:
        name, path, random, chat_template, instruct, model_type, hub_id, eot_token_id = \
            "local", str(tmp_path / "llada"), None, "auto", True, "llada", None, None
    lm = load_model(M, "cpu", "auto")
    assert (lm.eos_id, lm.eot_id) == (ids["<|endoftext|>"], ids["<|eot_id|>"])
    cls = strategy_class("low_confidence")
    seen = {}

    class Spy(cls):
        def init_state(self, canvas):
            seen["ids"] = (canvas.eos_id, canvas.eot_id)
            return super().init_state(canvas)

    stats = run_prompts(lm, [lm.encode("hi")], lambda: Spy(cls.Config(logits_eos_inf=True), 16),
                        lambda: cache_class("none")(cache_class("none").Config()), 16, 1, warmup=False)
    assert seen["ids"] == (lm.eos_id, lm.eot_id)
    assert lm.eos_id not in stats.rows[0].tokens
