"""Values Hydra's types let through: NaN/inf floats, integers beyond 64 bits, seeds; non-finite weights at
load and non-finite logits at the first forward."""
import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from conftest import run_dlm
from dlm_engine.app.config import check_values
from dlm_engine.errors import ConfigError, NonFiniteError, UserError, check_finite_logits


@pytest.mark.parametrize("cfg, needle", [
    ({"strategy": {"temperature": math.nan}}, "strategy.temperature=nan is not a finite number"),
    ({"strategy": {"temperature": math.inf}}, "strategy.temperature=inf is not a finite number"),
    ({"cache": {"ratios": [0.5, -math.inf]}}, "cache.ratios[1]=-inf is not a finite number"),
    ({"seed": 1 << 64}, "seed=18446744073709551616 is outside 0..9223372036854775807"),
    ({"seed": -1}, "seed=-1 is outside"),
    ({"model": {"random_seed": 1 << 63}}, "model.random_seed=9223372036854775808 is outside"),
    ({"gen_length": 10 ** 30}, "gen_length=1000000000000000000000000000000 does not fit in 64 bits"),
])
def test_check_values_names_the_key(cfg, needle):
    with pytest.raises(ConfigError) as exc:
        check_values(OmegaConf.create(cfg))
    assert needle in str(exc.value)


def test_finite_values_pass():
    check_values(OmegaConf.create({"seed": (1 << 63) - 1, "strategy": {"temperature": 0.7, "k": [1, 2.5]},
                                   "flag": True, "name": "nan"}))


@pytest.mark.slow
def test_temperature_nan_on_the_command_line_is_one_line(tmp_path):
    proc = run_dlm([f"hydra.run.dir={tmp_path / 'r'}", "device=cpu", "prompts=[hi]", "strategy.temperature=nan"],
                   cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines == ["dlm: error: strategy.temperature=nan is not a finite number"], proc.stderr
    assert not (tmp_path / "r").exists()


def test_non_finite_weights_are_refused_at_load(tmp_path):
    from test_bad_checkpoints import tiny_checkpoint

    from safetensors.torch import load_file, save_file

    from dlm_engine.models.loader import load_pretrained

    ck = tiny_checkpoint(tmp_path / "ck")
    w = load_file(str(ck / "model.safetensors"))
    key = sorted(k for k in w if w[k].is_floating_point())[0]
    w[key] = torch.full_like(w[key], float("nan"))
    save_file(w, str(ck / "model.safetensors"))
    with pytest.raises(UserError) as exc:
        load_pretrained(ck)
    msg = str(exc.value)
    assert f"weight '{key}'" in msg and "model.safetensors" in msg and f"{w[key].numel()} non-finite" in msg


def test_first_forward_logits_check():
    ok = torch.randn(2, 3, 8)
    ok[..., 5] = float("-inf")                          # a suppressed token: normal
    check_finite_logits(ok)
    for poison, needle in ((float("nan"), "1 NaN"), (float("inf"), "1 +inf")):
        bad = ok.clone()
        bad[1, 2, 0] = poison
        with pytest.raises(NonFiniteError, match=re.escape(needle)):
            check_finite_logits(bad)
    dead = ok.clone()
    dead[0, 1, :] = float("-inf")
    with pytest.raises(NonFiniteError, match="1 positions with only -inf"):
        check_finite_logits(dead)


def test_non_finite_logits_at_the_first_forward_stop_the_decode(tiny_llada):
    """The loop checks the first forward's logits: a model producing NaN stops with one NonFiniteError."""
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import strategy_class
    from dlm_engine.errors import NonFiniteError, UserError

    class NaNModel:
        logits_shift = 0

        def __call__(self, *a, **kw):
            call = tiny_llada(*a, **kw)
            call.logits = call.logits * float("nan")
            return call

    from dlm_engine.core.loop import Sink

    class Seen(Sink):
        deltas = 0

        def on_delta(self, delta, canvas):
            self.deltas += 1

    cls = strategy_class("threshold")
    canvas = Canvas.from_prompts([[5, 6, 7]], 8, 1000, 1001)
    seen = Seen()
    with pytest.raises(NonFiniteError, match="non-finite logits at the first forward") as err:
        decode(NaNModel(), canvas, cls(cls.Config(), 8), sinks=[seen])
    # read in the step's one host sync: the first step is the last, and no sink (trace, progress) saw it
    assert isinstance(err.value, UserError) and canvas.nfe == 1 and seen.deltas == 0


HEALTH_CASES = [("cpu", torch.float32), ("cpu", torch.bfloat16), ("cpu", torch.float16), ("cpu", torch.float64)] + [
    pytest.param("cuda", dt, marks=pytest.mark.cuda)
    for dt in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("device,dtype", HEALTH_CASES)
def test_the_first_forward_health_flag(device, dtype):
    """NaN, +inf or a position whose logits are all -inf are unhealthy; -inf on some tokens (suppressed EOS) is not;
    a finite logit at the dtype's largest value is healthy. The same flags on every device and dtype (the check's
    reductions must propagate NaN there too)."""
    from dlm_engine.core.loop import all_finite as values, healthy

    def flags(logits):       # per row, what the host tells from the values read back
        v = values(logits)
        assert v.dim() == 1 and v.dtype in (torch.float32, torch.float64)   # (read in one cat with exact counts)
        return [healthy([x]) for x in v.tolist()]

    ok = torch.randn(2, 3, 5).to(device=device, dtype=dtype)
    ok[1, 0, 4] = torch.finfo(dtype).max
    ok[..., 1] = float("-inf")
    assert flags(ok) == [True, True]        # one flag per row (read in the step's one sync as is)
    big = ok.clone()
    big[0, :, 0] = torch.finfo(dtype).max   # every position at the largest value: no overflow to a false alarm
    assert flags(big) == [True, True]
    for value, where in ((float("nan"), (1, 2, 3)), (float("inf"), (0, 0, 0))):
        bad = ok.clone()
        bad[where] = value
        assert flags(bad) == [where[0] != 0, where[0] != 1]
    dead = ok.clone()
    dead[1, 1, :] = float("-inf")
    assert flags(dead) == [True, False]
    assert flags(ok[:, :0]) == [True, True]     # a call with no positions


@pytest.mark.parametrize("device,dtype", HEALTH_CASES)
@pytest.mark.parametrize("kind", ["prob", "margin", "entropy", "inv_entropy"])
def test_the_health_flag_from_the_first_steps_confidences(device, dtype, kind):
    """The loop reads the first forward's health from the step's confidences where they come from the softmax of
    every position's logits (:func:`confidence_health`): the same flags as the logits' own check
    (:func:`all_finite`) for NaN, +inf, an all -inf position, suppressed tokens and logits at the dtype's largest
    value, whatever the softmax dtype and temperature; no flags (the logits are checked) where the confidences do
    not cover every position that way."""
    from dlm_engine.core.loop import all_finite, confidence_health, healthy
    from dlm_engine.core.sampler import propose
    from dlm_engine.core.strategy import StepPlan

    def flags(values):
        return [healthy([x]) for x in values.tolist()]

    ok = torch.randn(3, 4, 6).to(device=device, dtype=dtype)
    ok[..., 1] = float("-inf")                  # a suppressed token: healthy
    ok[2, 0, 4] = torch.finfo(dtype).max        # a finite logit at the dtype's largest value: healthy
    cases = [ok]
    for value, where in ((float("nan"), (1, 2, 3)), (float("inf"), (0, 0, 0)), (float("nan"), (2, 3, 1))):
        bad = ok.clone()
        bad[where] = value
        cases.append(bad)
    dead = ok.clone()
    dead[1, 1, :] = float("-inf")
    cases.append(dead)
    for logits in cases:
        want = flags(all_finite(logits))
        for softmax_dtype in ("model", "float64"):
            for temperature in (0.0, 0.7):
                plan = StepPlan(window=(0, 4), confidence=kind, softmax_dtype=softmax_dtype, temperature=temperature)
                proposal = propose(logits, 0, temperature=temperature, confidence=kind, softmax_dtype=softmax_dtype)
                got = confidence_health(plan, proposal)
                if proposal.confidence.dtype == torch.float16 and kind == "inv_entropy":
                    # CadLLM's float16 entropy (the spec's log(p + 1e-12)) is NaN wherever a probability underflows
                    # to 0 (a suppressed token here): it cannot tell, so the logits are checked
                    assert got is None and not all(flags(proposal.confidence.sum(-1, dtype=torch.float64)))
                    continue
                assert got is not None and got.dtype == torch.float64 and got.shape == (3,)
                assert flags(got) == want, (kind, softmax_dtype, temperature, want)
    assert sum(not f for c in cases for f in flags(all_finite(c))) == 4        # (the cases are unhealthy as meant)
    # confidences that do not tell: the logits are checked instead
    plain = dict(window=(0, 4), confidence=kind)
    proposal = propose(ok, 0, temperature=0.0, confidence=kind)
    assert confidence_health(StepPlan(**plain, sample=False), proposal) is None
    assert confidence_health(StepPlan(**{**plain, "confidence": "random"}),
                             propose(ok, 0, temperature=0.0, confidence="random")) is None
    if kind in ("prob", "inv_entropy"):
        cut = propose(ok, 0, temperature=0.0, confidence=kind, top_v=3)
        assert confidence_health(StepPlan(**plain, top_v=3), cut) is None
    valid = torch.ones(3, 4, dtype=torch.bool, device=device)
    valid[0, 1] = False
    assert confidence_health(StepPlan(**plain), propose(ok, 0, temperature=0.0, confidence=kind, valid=valid)) is None
    proposal.masked_confidence = True
    assert confidence_health(StepPlan(**plain), proposal) is None


@pytest.mark.parametrize("name, poison", [("threshold", "nan"), ("threshold", "inf"), ("threshold", "dead"),
                                          ("low_confidence", "inf"), ("factor", "dead"), ("d2c", "nan"),
                                          ("cadllm", "inf")])
def test_every_kind_of_bad_first_forward_stops_the_decode(tiny_llada, name, poison):
    """Whether the health comes from the confidences (threshold, low_confidence, factor) or from the logits (d2c samples
    itself, CadLLM cuts to a top-V), a first forward with a NaN, a +inf or an all -inf position (one position of one
    row) stops the decode with one NonFiniteError, before any sink sees a step."""
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import Sink, decode
    from dlm_engine.core.registry import strategy_class
    from dlm_engine.errors import NonFiniteError

    class Poisoned:
        logits_shift = 0

        def __call__(self, *a, **kw):
            call = tiny_llada(*a, **kw)
            lg = call.logits.clone()
            if poison == "dead":
                lg[-1, -1, :] = float("-inf")
            else:
                lg[-1, -1, 3] = float(poison)
            call.logits = lg
            return call

        def __getattr__(self, key):
            return getattr(tiny_llada, key)

    class Seen(Sink):
        deltas = 0

        def on_delta(self, delta, canvas):
            self.deltas += 1

    cls = strategy_class(name)
    kw = {"initial_block_length": 8, "min_block": 4, "max_block": 8} if name == "cadllm" else {"block_length": 8}
    prompts = [[5, 6, 7], [8, 9, 10]][:cls.max_batch or 2]        # (CadLLM decodes one row at a time)
    canvas = Canvas.from_prompts(prompts, 8, int(tiny_llada.config.mask_token_id), 0)
    seen = Seen()
    with pytest.raises(NonFiniteError, match="non-finite logits at the first forward"):
        decode(Poisoned(), canvas, cls(cls.Config(**kw), 8), sinks=[seen])
    assert canvas.nfe == 1 and seen.deltas == 0
