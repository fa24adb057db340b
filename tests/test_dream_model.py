"""The Dream model: forward parity with the reference, logit shift, windows under caches, loading."""
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dlm_engine.core.protocol import Columns, NullHooks
from dlm_engine.models.loader import load_pretrained

DREAM = Path(__file__).resolve().parent / "fixtures" / "dreamparity"


@pytest.fixture(scope="module")
def tiny_dream():
    model, raw, digest = load_pretrained(DREAM / "tiny_dream", device="cpu", dtype="float32")
    return model


def _raw(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, shift_logits=False).logits


def test_forward_matches_reference(tiny_dream):
    ref = json.loads((DREAM / "model_forward.json").read_text())
    assert len(ref["cases"]) >= 6
    for case in ref["cases"]:
        ids = torch.tensor(case["input_ids"])
        mask = torch.tensor(case["attention_mask"]) if "attention_mask" in case else None
        logits = _raw(tiny_dream, ids, mask)
        for row in case["rows"]:
            sel = logits[row["row"], row["positions"]]
            top = sel.topk(5, dim=-1)
            assert top.indices.tolist() == row["top5_ids"], case["name"]
            # the fixture rounds logits to 4 decimals; the rest is float32 rounding of this machine's BLAS
            assert torch.allclose(top.values, torch.tensor(row["top5_logits"]), atol=1e-4, rtol=0)
            assert torch.allclose(sel.logsumexp(-1), torch.tensor(row["logsumexp"]), atol=1e-4, rtol=0)
            assert torch.allclose(sel.softmax(-1).max(-1).values, torch.tensor(row["max_prob"]), atol=1e-5, rtol=0)


def test_logit_shift(tiny_dream):
    """Column j is predicted from hidden state j-1; column 0 reuses its own (spec §2.5)."""
    ids = torch.tensor([[406, 710, 869, 657, 230, 402] + [1000] * 10])
    raw = _raw(tiny_dream, ids)
    with torch.no_grad():
        call = tiny_dream(ids)
    assert call.logits_range == (0, ids.shape[1])
    expected = torch.cat([raw[:, :1], raw[:, :-1]], dim=1)
    assert torch.equal(call.logits, expected)
    assert tiny_dream.logits_shift == 1


@pytest.mark.parametrize("lo, hi", [(0, 1), (0, 5), (1, 4), (6, 16), (15, 16), (3, 3)])
def test_logits_window_is_slice_of_full(tiny_dream, lo, hi):
    ids = torch.tensor([[406, 710, 869, 657, 230, 402] + [1000] * 10])
    with torch.no_grad():
        full = tiny_dream(ids).logits
        part = tiny_dream(ids, logits_range=(lo, hi))
    assert part.logits_range == (lo, hi) and part.valid is None
    assert torch.allclose(part.logits, full[:, lo:hi], atol=1e-5)


def test_left_padding_equals_row_alone(tiny_dream):
    ids = torch.tensor([[406, 710, 869, 657, 230, 402] + [1000] * 8])
    padded = torch.cat([torch.full((1, 3), 1001), ids], dim=1)
    mask = torch.ones_like(padded, dtype=torch.bool)
    mask[:, :3] = False
    with torch.no_grad():
        alone = tiny_dream(ids).logits
        pl = tiny_dream(padded, attention_mask=mask).logits
    assert torch.allclose(alone[:, 1:], pl[:, 4:], atol=1e-4)
    assert torch.isfinite(pl).all()


class _Narrow(NullHooks):
    """A stand-in for a cache that recomputes only columns [s, e) (ignores the requested range)."""

    def __init__(self, s, e):
        self.s, self.e = s, e
        self.seen = None

    @contextmanager
    def forward(self, call):
        self.seen = (tuple(call.logits_range), call.logits_shift)
        call.columns = Columns.span(self.s, self.e)
        yield call


def test_cache_sees_the_shift_and_model_reports_valid_columns(tiny_dream):
    ids = torch.tensor([[406, 710, 869, 657, 230, 402] + [1000] * 10])
    with torch.no_grad():
        full = tiny_dream(ids).logits
        hooks = _Narrow(6, 16)
        call = tiny_dream(ids, hooks=hooks, logits_range=(6, 12))
    assert hooks.seen == ((6, 12), 1)            # the cache sees the window and that column j reads hidden j-1
    # hidden 5 was not recomputed, so column 6 cannot be produced exactly: it is invalid (zeros), not faked
    assert call.logits.shape == (1, 6, 1024)
    assert call.valid.tolist() == [[False, True, True, True, True, True]]
    assert torch.equal(call.logits[:, 0], torch.zeros(1, 1024))
    with torch.no_grad():
        ok = tiny_dream(ids, hooks=_Narrow(5, 16), logits_range=(6, 12))
    assert ok.valid is None and ok.logits.shape == full[:, 6:12].shape


def test_per_row_column_sets_give_logits_where_computed(tiny_dream, tiny_llada):
    """Protocol v2: a cache may feed an arbitrary set of columns per row; the window's logits are valid
    exactly where the source hidden state (j - shift) was computed, zeros elsewhere."""
    ids = torch.tensor([[406, 710, 869, 657, 230, 402] + [1000] * 10] * 2)

    class Rows(NullHooks):
        def __init__(self, index):
            self.index = index

        @contextmanager
        def forward(self, call):
            call.columns = Columns.indexed(self.index)
            yield call

    index = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 9, 10], [0, 1, 2, 3, 4, 5, 7, 8, 12]])
    for model, shift in ((tiny_dream, 1), (tiny_llada, 0)):
        with torch.no_grad():
            call = model(ids, hooks=Rows(index), logits_range=(6, 14))
        src = torch.arange(6, 14) - shift
        want = torch.stack([torch.isin(src, r) for r in index])
        assert torch.equal(call.valid, want), model
        assert torch.equal(call.logits[~want], torch.zeros(int((~want).sum()), call.logits.shape[-1]))
        assert torch.isfinite(call.logits).all()
        # each row equals the model run on that row's columns alone (original positions kept)
        for b in range(2):
            sub = ids[b:b + 1, index[b]]
            with torch.no_grad():
                raw = {"shift_logits": False} if shift else {}   # per hidden state, unshifted
                alone = model(sub, position_ids=index[b:b + 1], **raw).logits[0]
            for w, j in enumerate(range(6, 14)):
                if want[b, w]:
                    at = int((index[b] == max(j - shift, 0)).nonzero())
                    assert torch.allclose(call.logits[b, w], alone[at], atol=1e-4, rtol=1e-5), (b, j, (call.logits[b, w] - alone[at]).abs().max())


def test_official_parameter_names_and_shapes(tiny_dream):
    sd = tiny_dream.state_dict()
    assert sd["model.embed_tokens.weight"].shape == (1024, 64)
    assert sd["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)   # 2 KV heads x 16
    assert sd["model.layers.1.self_attn.v_proj.bias"].shape == (32,)
    assert "model.layers.1.self_attn.o_proj.bias" not in sd
    assert sd["model.layers.1.mlp.gate_proj.weight"].shape == (128, 64)
    assert sd["model.norm.weight"].shape == (64,)
    assert sd["lm_head.weight"].shape == (1024, 64)


def test_auto_classes_without_remote_code(tmp_path):
    import shutil

    from transformers import AutoConfig, AutoModel

    from dlm_engine.models.dream import DreamModel, register_auto_classes

    register_auto_classes()
    d = tmp_path / "dream"
    shutil.copytree(DREAM / "tiny_dream", d)
    cfg = json.loads((d / "config.json").read_text())
    # the hub checkpoints point at their remote code; it must never be needed
    cfg["auto_map"] = {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}
    (d / "config.json").write_text(json.dumps(cfg))
    conf = AutoConfig.from_pretrained(str(d), trust_remote_code=False)
    assert conf.model_type == "Dream" and conf.num_key_value_heads == 2
    model = AutoModel.from_pretrained(str(d), trust_remote_code=False)
    assert isinstance(model, DreamModel)
    ours, _, _ = load_pretrained(d)
    for (k1, v1), (k2, v2) in zip(sorted(model.state_dict().items()), sorted(ours.state_dict().items())):
        assert k1 == k2 and torch.equal(v1, v2)


def test_unsupported_config_is_a_clear_error(tmp_path):
    import shutil

    from dlm_engine.errors import UserError

    d = tmp_path / "dream"
    shutil.copytree(DREAM / "tiny_dream", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="rope_scaling"):
        load_pretrained(d)
