"""Issue 45 item 6, lm-eval on the block-diffusion families: the adapter loads an official-format checkpoint;
loglikelihood uses the per-block bound (each block given the clean blocks before it) and is_greedy decodes in the
model's blocks. The tiny checkpoints have no tokenizer, so text requests stop with a one-line error and the
likelihood functions are checked on token ids."""
import pytest
import torch

from conftest import FIXTURES
from dlm_engine.app.api import load_directory
from dlm_engine.errors import UserError
from dlm_engine.integrations.likelihood import greedy_matches, mc_loglikelihood

BD = FIXTURES / "bdparity"


@pytest.fixture(scope="module", params=["tiny_sdar", "tiny_fdv2", "tiny_llada2"])
def lm(request):
    return load_directory(str(BD / request.param), name=request.param)


def test_one_token_per_block_is_exact(lm):
    """A continuation with one token in each of two blocks: the bound is log p(y0 | c) + log p(y1 | c, y0)."""
    bs = lm.model.block_size
    ctx = list(range(40, 40 + bs - 1))           # the continuation starts at the last column of block 0
    y = [50, 51]
    P = len(ctx)
    g = torch.Generator().manual_seed(0)
    est = mc_loglikelihood(lm, ctx, y, samples=3, batch_size=2, generator=g)
    want = 0.0
    with torch.no_grad():
        for i in range(2):
            ids = torch.tensor([ctx + y])
            ids[0, P + i] = lm.mask_id
            logits = lm.model(ids, logits_range=(P + i, P + i + 1)).logits
            want += float(torch.log_softmax(logits.double(), -1)[0, 0, y[i]])
    assert est == pytest.approx(want, abs=1e-4)      # (float32 rounding of other batch shapes)


def test_the_estimate_does_not_depend_on_the_batch_size(lm):
    bs = lm.model.block_size
    ctx, y = [40, 41, 42], list(range(60, 60 + bs + 3))
    a = mc_loglikelihood(lm, ctx, y, 6, 1, torch.Generator().manual_seed(1))
    b = mc_loglikelihood(lm, ctx, y, 6, 5, torch.Generator().manual_seed(1))
    assert a == pytest.approx(b, rel=1e-6) and a < 0


def test_is_greedy_decodes_in_the_model_blocks(lm):
    bs = lm.model.block_size
    from dlm_engine.app.api import run_prompts
    from dlm_engine.core.registry import cache_class, load_plugins, strategy_class

    load_plugins()
    S, C = strategy_class("low_confidence"), cache_class("none")
    cfg = S.Config(steps=2 * bs, block_length=bs, temperature=0.0, remasking="low_confidence")
    ctx = [40, 41, 42]
    out = run_prompts(lm, [ctx], lambda: S(cfg, 2 * bs), lambda: C(C.Config()), gen_length=2 * bs, batch_size=1,
                      warmup=False).rows[0].tokens
    L = bs + 1                                  # not a multiple of the block size: no ConfigError
    assert greedy_matches(lm, [ctx, ctx], [out[:L], [out[0] + 1] + out[1:L]]) == [True, False]


@pytest.mark.slow      # (an lm-eval harness run: ~2 s on 2 cores)
def test_lm_eval_adapter_loads_a_block_diffusion_checkpoint():
    pytest.importorskip("lm_eval")
    from dlm_engine.integrations.lm_eval import DLMEngineLM

    ad = DLMEngineLM(model="local", device="cpu", strategy="sdar", cache="block_kv", gen_length=16,
                     **{"model.path": str(BD / "tiny_sdar"), "strategy.block_length": 4})
    assert getattr(ad.lm.model, "block_diffusion", False) and ad.lm.tokenizer is None

    class Req:
        def __init__(self, args):
            self.args = args

    with pytest.raises(UserError, match="has no tokenizer") as e:
        ad.generate_until([Req(("2+2=", {"until": ["\n"]}))])
    assert "\n" not in str(e.value)
    with pytest.raises(NotImplementedError, match="has no tokenizer"):
        ad.loglikelihood([Req(("a", "b"))])
