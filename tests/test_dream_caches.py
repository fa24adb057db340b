"""KV caches with a shifted-logits model (Dream): cached calls recompute the hidden state that feeds the
first requested column, so a cached call on an unchanged canvas gives the uncached logits."""
from pathlib import Path

import pytest
import torch

from dlm_engine.models.loader import load_pretrained
from dlm_engine.core.registry import CACHES, cache_class, load_plugins
from dlm_engine.core.protocol import CacheDirective, CallRequest

DREAM = Path(__file__).resolve().parent / "fixtures" / "dreamparity" / "tiny_dream"


@pytest.fixture(scope="module")
def model():
    return load_pretrained(DREAM, device="cpu", dtype="float32")[0]


def _stored_caches():
    load_plugins()
    from dlm_engine.core.kvcache import StoredKVCache

    return sorted(n for n, c in CACHES.items() if issubclass(c, StoredKVCache))


@pytest.mark.parametrize("name", _stored_caches())
def test_cached_call_on_unchanged_canvas_equals_full_call(model, name):
    ids = torch.tensor([[406, 710, 869, 657, 230, 402] + [1000] * 16])
    bs, be = 14, 22
    cache = cache_class(name)(cache_class(name).Config())
    cache.begin(None)
    with torch.no_grad():
        full = model(ids).logits
        model(ids, hooks=cache, logits_range=(bs, be),
              request=CallRequest(gen_start=6, directive=CacheDirective(block=(bs, be), block_start=True)))
        call = model(ids, hooks=cache, logits_range=(bs, be),
                     request=CallRequest(gen_start=6, directive=CacheDirective(block=(bs, be), block_start=False,
                                                                               step_in_block=1)))
    assert call.compute[0] <= bs - 1 < call.compute[1]      # the hidden state of column bs-1 was recomputed
    assert call.logits_range == (bs, be) and call.valid is None
    assert torch.allclose(call.logits, full[:, bs:be], atol=1e-5)


def test_every_strategy_and_cache_pair_decodes_a_dream_batch(model):
    """Every registered strategy with every compatible cache runs on a left-padded Dream batch (in batches of its
    ``max_batch``, as the API feeds it)."""
    from dlm_engine.core.capabilities import incompatibility

    from conftest import batch_cache, decode_in_batches, small_strategies

    load_plugins()
    ran = []
    for sname, strategy in small_strategies(16):
        for cname, ccls in CACHES.items():
            if incompatibility(strategy, ccls()) is not None:
                continue
            for canvas in decode_in_batches(model, [[406, 710, 869, 657, 230, 402], [432, 865, 699]], 16, strategy,
                                            lambda: batch_cache(cname)):
                assert not canvas.masked()[:, canvas.gen_start:].any(), (sname, cname)
            ran.append((sname, cname))
    assert ("low_confidence", "dual") in ran and ("dream", "prefix") in ran
