"""``core/fast/row_max.py: row_max``: the vocabulary-wide max/argmax taken by chunks on a CPU (torch's max-with-index reduction
runs element by element there). It must return torch's own values and indices bit for bit -- first maximum among
ties, first NaN, infinities -- and decodes that take it must make the very tokens of decodes that do not."""
import pytest
import torch

import dlm_engine.core.fast.row_max as sampler      # (the module of row_max and its chunk constants)
from dlm_engine.core.canvas import Canvas
from dlm_engine.core.loop import decode
from dlm_engine.core.registry import cache_class, strategy_class
from fakes import CommittedDeltas

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def hostile(kind: int, shape, g: torch.Generator) -> torch.Tensor:
    """Rows with the cases where a wrong first-maximum rule shows: ties (few distinct values, a peaked softmax
    that rounds to equal probabilities), NaN, +inf, rows of -inf with a few finite entries, signed zeros."""
    if kind == 0:
        return torch.randn(shape, generator=g)
    if kind == 1:
        return torch.randint(0, 3, shape, generator=g).float()
    if kind == 2:
        return torch.softmax(torch.randn(shape, generator=g).to(torch.bfloat16).float() * 20, -1)
    x = torch.randn(shape, generator=g)
    hit = torch.rand(shape, generator=g) < 0.01
    if kind == 3:
        x[hit] = float("nan")
    elif kind == 4:
        x = torch.full(shape, float("-inf"))
        few = torch.rand(shape, generator=g) < 0.05
        x[few] = torch.randn(int(few.sum()), generator=g)
    elif kind == 5:
        x[hit] = float("inf")
    else:
        zeros = torch.where(torch.rand(shape, generator=g) < 0.5, 0.0, -0.0)
        x = zeros - torch.rand(shape, generator=g).lt(0.9).float()        # maxima of +0 and -0
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (NaN and signed zeros included), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a, b)


def count_chunked(monkeypatch, chunk=None) -> list:
    """The calls of ``sampler.chunked_max`` from now on (one entry a call); with ``chunk``, the chunked path forced for
    every size (its limits lowered, ``chunk``-wide chunks)."""
    calls = []
    orig = sampler.chunked_max
    monkeypatch.setattr(sampler, "chunked_max", lambda *a, **k: calls.append(a[0].shape) or orig(*a, **k))
    if chunk is not None:
        for key, value in (("MAX_CHUNK", chunk), ("CHUNKED_MAX_MIN", 0), ("CHUNKED_MAX_MIN_V", 0)):
            monkeypatch.setattr(sampler, key, value)
    return calls


@pytest.mark.parametrize("chunk", [64, 16])
def test_chunked_max_is_torch_max_bit_for_bit(monkeypatch, chunk):
    monkeypatch.setattr(sampler, "MAX_CHUNK", chunk)
    g = torch.Generator().manual_seed(chunk)
    for it in range(700):
        lead = [(int(torch.randint(1, 9, (1,), generator=g)),), (2, int(torch.randint(1, 5, (1,), generator=g))),
                ()][it % 3]
        V = chunk * int(torch.randint(1, 24, (1,), generator=g))
        x = hostile(it % 7, tuple(lead) + (V,), g)
        for dt in DTYPES:
            y = x.to(dt)
            ref_v, ref_i = y.max(dim=-1)
            v, i = sampler.chunked_max(y)
            assert same(v, ref_v) and torch.equal(i, ref_i), (it % 7, dt, tuple(y.shape))
            assert torch.equal(sampler.chunked_max(y, values=False), y.argmax(dim=-1)), (it % 7, dt, tuple(y.shape))


def test_row_max_takes_chunks_where_they_pay_and_torch_elsewhere(monkeypatch):
    calls = count_chunked(monkeypatch)
    big = torch.randn(32, 4096)
    for x, chunked in [(big, True), (big.view(2, 16, 4096), True), (big[:, :4032], False),   # not contiguous
                       (torch.randn(4, 4096), False),                      # too few elements
                       (torch.randn(512, 128), False),                     # a small vocabulary
                       (torch.randn(32, 4100), False),                     # not a multiple of the chunk
                       (torch.randint(0, 9, (32, 4096)), False)]:          # integers
        calls.clear()
        v, i = sampler.row_max(x)
        ref_v, ref_i = x.max(dim=-1)
        assert torch.equal(v, ref_v) and torch.equal(i, ref_i)
        assert torch.equal(sampler.row_max(x, values=False), x.argmax(dim=-1))
        assert bool(calls) == chunked, tuple(x.shape)


CASES = [
    ("low_confidence", {"block_length": 8, "steps": 16}),
    ("low_confidence", {"block_length": 8, "steps": 16, "temperature": 0.7}),
    ("threshold", {"block_length": 8, "threshold": 0.7}),
    ("factor", {"block_length": 8}),
    ("early_exit", {"block_length": 8, "steps": 16, "answer_start": 0}),
    ("cadllm", {"initial_block_length": 8, "min_block": 4, "max_block": 8}),
    ("block_buffer", {"block_length": 4, "buffer_size": 3, "temperature": 0.6}),
    ("d2c", {"block_length": 8}),
    ("d2c", {"block_length": 8, "gamma": 0.01}),
    ("d2c", {"block_length": 8, "debias": True, "freq_table": "llada"}),
    ("klass", {"block_length": 8, "threshold": 0.9}),
    ("wino", {"block_length": 8}),
]


def run(model, name, kw, fast=True):
    cls = strategy_class(name)
    strategy = cls(cls.Config(**kw), 16)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]][:cls.max_batch or 3]
    canvas = Canvas.from_prompts(prompts, 16, int(model.config.mask_token_id), 0,
                                 eos_id=int(model.config.eos_token_id))
    sink = CommittedDeltas()
    torch.manual_seed(0)
    decode(model, canvas, strategy, cache_class("none")(), sinks=[sink], fast=fast)
    return canvas.tokens.tolist(), canvas.step_of.tolist(), canvas.nfe, sink.seen


@pytest.mark.parametrize("name, kw", CASES)
def test_decodes_by_chunks_make_the_same_tokens(tiny_llada, monkeypatch, name, kw):
    """The embedded model's vocabulary (128) is below the chunked path's size limits: lowered here, every
    vocabulary-wide maximum of the decode goes by 16-wide chunks."""
    plain = run(tiny_llada, name, kw)
    calls = count_chunked(monkeypatch, 16)
    assert run(tiny_llada, name, kw) == plain
    assert calls, "the decode never took the chunked path"


def test_the_plain_path_takes_torchs_own_maximum(tiny_llada, monkeypatch):
    """The chunked maximum is a fast-layer shortcut: ``decode(..., fast=False)`` never takes it (and makes the same
    tokens), even where its limits would."""
    fast = run(tiny_llada, "threshold", {"block_length": 8, "threshold": 0.7})
    calls = count_chunked(monkeypatch, 16)
    assert run(tiny_llada, "threshold", {"block_length": 8, "threshold": 0.7}, fast=False) == fast
    assert not calls
    run(tiny_llada, "threshold", {"block_length": 8, "threshold": 0.7})
    assert calls                                    # (the fast path does, with the same limits)


@pytest.mark.parametrize("kw", [{}, {"alg": "topk_margin"}, {"alg": "entropy", "top_k": 5}])
def test_dream_decodes_by_chunks_make_the_same_tokens(tiny_dream_model, monkeypatch, kw):
    def dream_run():
        cls = strategy_class("dream")
        canvas = Canvas.from_prompts([[5, 6, 7], [8, 9]], 16, 1000, 1001)
        sink = CommittedDeltas()
        decode(tiny_dream_model, canvas, cls(cls.Config(steps=8, **kw), 16), cache_class("none")(), sinks=[sink])
        return canvas.tokens.tolist(), canvas.step_of.tolist(), sink.seen

    plain = dream_run()
    calls = count_chunked(monkeypatch, 8)
    assert dream_run() == plain
    assert calls, "the decode never took the chunked path"
