"""The step loop's op-saving shortcuts give what the long forms give (issue 17: fewer dispatched operations a step).

Each shortcut is compared with the form it replaced, on inputs with exact ties where ties matter.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.core.sampler import ALGS, sample_tokens
from dlm_engine.core.selection import NEG_INF, column_range, top1, topk_commit, topk_rows


def op_recorder(ops: list):
    """A dispatch mode that appends the name of every tensor operation run inside it to ``ops``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    return Record()


class Asks:
    """A strategy's host-read side only: asks for ``parts`` and keeps the values it is handed in ``seen``."""

    def __init__(self, parts, seen: dict, after=None):
        self.parts, self.seen, self.after = parts, seen, after

    def reads(self, canvas, state):
        return self.parts

    def settle(self, canvas, state, values, delta):
        self.seen["values"] = values
        return self.after


def test_canvas_cols_are_views_of_the_current_tensors():
    c = Canvas.from_prompts([[5, 6], [7]], 6, 3, 0)
    tok, so = c.cols(2, 5)
    assert torch.equal(tok, c.tokens[:, 2:5]) and torch.equal(so, c.step_of[:, 2:5])
    c.step_of[0, 3] = 7                                                # a view: sees writes to the canvas
    assert int(so[0, 1]) == 7
    so[1, 0] = 9                                                       # and writes through it change the canvas
    assert int(c.step_of[1, 2]) == 9
    m = c.masked_cols(2, 5)
    assert torch.equal(m, c.masked()[:, 2:5]) and torch.equal(c.masked_cols(2), c.masked()[:, 2:])
    m[:] = False                                                       # a fresh tensor, not a view of the canvas
    assert torch.equal(c.masked_cols(2, 5), c.masked()[:, 2:5]) and bool(c.masked_cols(2, 5).any())
    c.tokens = c.tokens.clone()                                        # replaced: views of the new tensor
    assert c.cols(2, 5)[0]._base is c.tokens
    with torch.inference_mode():                                       # a write through a view made inside
        c.cols(2, 5)[1].fill_(4)                                       # inference mode, then one outside it
    c.cols(2, 5)[1].fill_(5)                                           # (a view made there: no error)
    assert bool((c.step_of[:, 2:5] == 5).all())


def test_every_row_is_shared_by_canvases_of_one_batch_size():
    a, b = Canvas.from_prompts([[5], [6]], 4, 3, 0), Canvas.from_prompts([[7], [8]], 4, 3, 0)
    assert a.every_row() is b.every_row() and bool(a.every_row().all())
    assert Canvas.from_prompts([[5]], 4, 3, 0).every_row().shape == (1,)


def _ties(B, W, seed):
    g = torch.Generator().manual_seed(seed)
    conf = torch.randint(0, 4, (B, W), generator=g).double() / 4        # few values: many exact ties
    cand = torch.rand(B, W, generator=g) < 0.7
    return conf, cand


@pytest.mark.parametrize("seed", range(8))
def test_one_pick_topk_commit_and_top1_match_the_scattered_forms(seed):
    for B, W, span in ((1, 8, None), (3, 8, (4, 20)), (2, 16, (0, 16)), (3, 5, (7, 12))):
        conf, cand = _ties(B, W, seed)
        if span is None:
            row, off = torch.where(cand, conf, NEG_INF), 0
        else:
            off = span[0]
            row = torch.full((B, span[1]), NEG_INF, dtype=conf.dtype)
            row[:, off:off + W] = torch.where(cand, conf, NEG_INF)
        idx = torch.topk(row, 1, dim=-1).indices
        scattered = torch.zeros_like(row, dtype=torch.bool).scatter_(1, idx, True)[:, off:off + W] & cand
        assert torch.equal(topk_commit(conf, cand, [1] * B, span), scattered)
        assert torch.equal(topk_commit(conf, cand, 1, span), scattered)
        counts = [int(n) for n in cand.sum(-1)]
        if all(n == counts[0] for n in counts) and counts[0] > 0:
            first = torch.topk(row, counts[0], dim=-1).indices[:, :1]
            want = torch.zeros_like(row, dtype=torch.bool).scatter_(1, first, True)[:, off:off + W] & cand
            assert torch.equal(top1(conf, cand, span, counts), want)
        want = torch.zeros_like(row, dtype=torch.bool).scatter_(1, row.argmax(-1, keepdim=True), True)[:, off:off + W]
        assert torch.equal(top1(conf, cand, span), want & cand)
        assert torch.equal(topk_rows(row, 1), torch.zeros_like(row, dtype=torch.bool).scatter_(1, idx, True))


def test_column_range():
    assert column_range(3, 7, torch.device("cpu")).tolist() == [[3, 4, 5, 6]]


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_k": 3}])
def test_sample_tokens_without_flattening_matches_row_by_row(alg, filters):
    """At temperature 0 the sampler runs on the logits' own shape: the same values as on the flattened rows."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g)
    logits[0, 1] = logits[0, 2]                           # a tied row
    torch.manual_seed(0)
    nd = sample_tokens(logits, 0.0, alg=alg, **filters)
    torch.manual_seed(0)
    flat = sample_tokens(logits.reshape(-1, 11), 0.0, alg=alg, **filters)
    assert nd.confidence.shape == (2, 5) and nd.probs.shape == (2, 5, 11)
    assert torch.equal(nd.confidence.reshape(-1), flat.confidence) and torch.equal(nd.x0.reshape(-1), flat.x0)
    assert torch.equal(nd.probs.reshape(-1, 11), flat.probs)


@pytest.mark.parametrize("k", [0, 1, 2, [1, 1, 1], [2, 1, 3], "tensor"])
def test_topk_rows_columns_are_the_cut_of_the_whole_row(k):
    conf, cand = _ties(3, 12, 5)
    row = torch.where(cand, conf, NEG_INF)
    k = torch.tensor([1, 3, 0]) if k == "tensor" else k
    for cols in ((0, 12), (3, 9), (0, 5), (11, 12)):
        assert torch.equal(topk_rows(row, k, cols=cols), topk_rows(row, k)[:, cols[0]:cols[1]])
        if not torch.is_tensor(k):             # (per-row padding columns: host counts only)
            lead = [0, 2, 1]
            assert torch.equal(topk_rows(row, k, lead=lead, cols=cols), topk_rows(row, k, lead=lead)[:, cols[0]:cols[1]])


def test_certainty_density_reuses_its_rows_and_gives_the_same_bits():
    from dlm_engine.core.priors import CertaintyDensity, certainty_density

    g = torch.Generator().manual_seed(3)
    dens = CertaintyDensity(5.0)
    # shapes change on the same object (a batch compacted to its live rows, another generation length)
    for B, L in [(3, 24), (3, 24), (1, 24), (2, 40), (3, 24)]:
        for _ in range(20):
            masked = torch.rand(B, L, generator=g) < float(torch.rand(1, generator=g))
            masked[0, -1] = bool(torch.rand(1, generator=g) < 0.5)          # the repeated last column varies
            got = dens.of_masked(masked)
            assert got.dtype == torch.float32
            assert torch.equal(got, certainty_density(~masked, 5.0))
    # the returned densities are not views of the reused rows: a later call leaves them alone
    m = torch.zeros(2, 8, dtype=torch.bool)
    first = dens.of_masked(m)
    kept = first.clone()
    dens.of_masked(torch.ones(2, 8, dtype=torch.bool))
    assert torch.equal(first, kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alpha", [None, 3.0])
def test_debias_with_precomputed_weights_is_the_reference_formula(dtype, alpha):
    from dlm_engine.core.priors import FrequencyTable, debias

    V = 4096
    freq = FrequencyTable.load(str(FrequencyTable.bundled_path("llada")), V)
    weights = FrequencyTable.weights(str(FrequencyTable.bundled_path("llada")), V)
    g = torch.Generator().manual_seed(int(alpha or 0) + (dtype == torch.float64))
    for shape in [(1, 16), (3, 7), (2, 33)]:
        conf = torch.rand(shape, generator=g, dtype=dtype)
        conf[0, 0] = 1.0
        x0 = torch.randint(0, V, shape, generator=g)
        x0[0, :3] = torch.tensor([0, V - 1, 5])                 # a rare, the last and a common token
        a = 10.0 if alpha is None else alpha
        want = torch.clamp(-conf * torch.log(freq.to(dtype)[x0] + 1e-10), max=a)   # the reference's order
        got = debias(conf, x0, weights, alpha)
        assert got.dtype == dtype and torch.equal(got, want)
        assert torch.equal(debias(conf, x0, freq, alpha), want)  # a bare table: its weights made for the call
        assert bool((got < a).any())                           # not every value clipped: the formula is exercised


@pytest.mark.parametrize("name", ["threshold", "factor"])
def test_block_rules_commit_candidates_only(name):
    """``FillBlocks.rule`` returns candidates only, whatever the scores (ties, ``-inf``) and the host counts."""
    from dlm_engine.core.blockwise import BlockCursor
    from dlm_engine.core.registry import load_plugins, strategy_class

    load_plugins()
    cls = strategy_class(name)
    kw = {"threshold": 0.5} if name == "threshold" else {"factor": 1.0}
    strat = cls(cls.Config(**kw), 12)
    g = torch.Generator().manual_seed(7)
    for trial in range(200):
        B, W = 3, 12
        conf = torch.randint(0, 4, (B, W), generator=g).to(torch.float64) / 4       # exact ties, values >= 0.5
        conf[torch.rand(B, W, generator=g) < 0.1] = float("-inf")
        cand = torch.rand(B, W, generator=g) < 0.6
        cand[0] = False if trial % 5 == 0 else cand[0]                                # a row with no candidate
        counts = cand.sum(-1).tolist()
        span = (2, W + 4) if trial % 2 else None
        for c in (counts, None):
            commit = strat.rule(conf, cand, BlockCursor(0, 0), span, c)
            assert not bool((commit & ~cand).any()), (trial, c)


def test_reads_given_as_parts_are_read_in_order_in_one_cat():
    """``Strategy.reads`` may return a list: its parts (any shape) are flattened and read after the loop's
    own (finished rows), promoted together, in one host read."""
    from dlm_engine.core.loop import sync_round

    canvas = Canvas.from_prompts([[5, 6], [7]], 4, 3, 0)
    canvas.finished[1] = True
    seen, ops = {}, []
    parts = Asks([torch.tensor([[1, 2], [3, 4]]), torch.tensor(True), torch.tensor([False, True])], seen, "next")
    with op_recorder(ops):
        host, state = sync_round(canvas, parts, None, None)
    assert host.finished == (False, True) and state == "next"
    assert seen["values"] == [1, 2, 3, 4, 1, 0, 1] and all(type(v) is int for v in seen["values"])
    assert sum("cat" in op for op in ops) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_top_v_prob_confidence_casts_inside_the_softmax_with_the_same_bits(dtype):
    from dlm_engine.core.sampler import confidence_of

    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(2, 9, 50, generator=g) * 4).to(dtype)
    logits[0, 0, :5] = logits[0, 0, 5]                       # exact ties around the top
    x0 = logits.float().argmax(-1)
    x0[1, 3] = int(logits[1, 3].float().argmin())            # a proposal outside the top-V: probability 0
    for top_v in (1, 7, 50):
        vals, idx = torch.topk(logits, top_v, dim=-1)
        want = torch.where(idx == x0[..., None], torch.softmax(vals.to(torch.float64), dim=-1), 0.0).sum(-1)
        got = confidence_of(logits, x0, "prob", top_v=top_v)
        assert got.dtype == torch.float64 and torch.equal(got, want)


@pytest.mark.parametrize("L, sigma", [(16, 10.0), (48, 5.0), (64, 2.0), (128, 2.0), (256, 10.0)])
def test_density_floor_bounds_every_density_and_says_when_one_can_be_zero(L, sigma):
    """``CertaintyDensity.positive`` lets d2c rank ``confidence * density`` without masking it again: it must only
    be True where no density of that length can be 0 (``-inf * 0`` would be NaN outside the candidates)."""
    from dlm_engine.core.priors import CertaintyDensity, density_floor

    dens = CertaintyDensity(sigma)
    g = torch.Generator().manual_seed(L)
    masks = [torch.ones(2, L, dtype=torch.bool), torch.rand(4, L, generator=g) < 0.9]
    masks[0][1, 0] = False                                   # decoded text at one end only
    lows = []
    for m in masks:
        d = dens.of_masked(m)
        lows.append(float(d.min()))
        bound = torch.tensor(density_floor(L, sigma) * (1 - 1e-6), dtype=torch.float64).float()   # (may be 0)
        assert bool(d.min() >= bound)
    if dens.positive:
        assert min(lows) > 0
    if density_floor(L, sigma) == 0.0 or min(lows) == 0.0:
        assert not dens.positive
    assert dens.positive == (density_floor(L, sigma) > 1e-30)


def test_masked_order_is_the_row_major_order_of_the_mask():
    from dlm_engine.core.selection import masked_order

    g = torch.Generator().manual_seed(0)
    for shape in ((1, 32), (3, 7), (2, 0)):
        mask = torch.rand(shape, generator=g) < 0.4
        assert torch.equal(masked_order(mask, int(mask.sum())), mask.reshape(-1).nonzero().view(-1))


def test_a_delta_that_finishes_no_row_leaves_finished_alone():
    from dlm_engine.core.canvas import Canvas, FrameDelta

    a = Canvas.from_prompts([[5, 6], [7]], 4, 99, 0)
    b = Canvas.from_prompts([[8, 9], [7]], 4, 99, 0)
    assert a.no_rows() is b.no_rows() and not a.no_rows().any()
    before = a.finished
    commit = torch.zeros(2, 4, dtype=torch.bool)
    commit[:, 0] = True
    a.apply(FrameDelta(step=1, nfe=1, start=a.gen_start, commit=commit, tokens=torch.full((2, 4), 3),
                       active=a.every_row(), finished=a.no_rows()))
    assert a.finished is before and not a.finished.any() and a.tokens[0, a.gen_start] == 3
    a.apply(FrameDelta(step=2, nfe=1, start=a.gen_start, commit=commit, tokens=torch.full((2, 4), 3),
                       active=a.every_row(), finished=torch.tensor([False, True])))
    assert a.finished.tolist() == [False, True] and not a.no_rows().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_health_values_read_with_counts_keep_them_exact_integers(dtype):
    """The first forward's health values (:func:`all_finite`) are read in the step's one ``cat`` with the finished
    rows and the strategy's counts: they are float64 whatever the logits' dtype, so counts above what bfloat16 or
    float32 hold exactly come back exact, and as ints."""
    from dlm_engine.core.loop import all_finite, sync_round

    canvas = Canvas.from_prompts([[5, 6], [7]], 4, 3, 0)
    seen = {}
    asks = Asks(torch.tensor([1025, 300, 2 ** 24 + 1]), seen)
    logits = torch.randn(2, 3, 7).to(dtype)
    host, _ = sync_round(canvas, asks, None, None, all_finite(logits))
    assert not host.bad and seen["values"] == [1025, 300, 2 ** 24 + 1] and all(type(v) is int for v in seen["values"])
    logits[1, 2, 0] = float("nan")
    host, _ = sync_round(canvas, asks, None, None, all_finite(logits))
    assert host.bad and seen["values"] == [1025, 300, 2 ** 24 + 1]


@pytest.mark.parametrize("G, bl", [(5, 8), (16, 32), (16, 16), (13, 4), (12, 4), (20, 6)])
def test_block_counts_are_the_masked_positions_per_block_one_op_for_one_block(G, bl):
    """``block_counts``: masked positions per row and block (the last block may be short); a generation that is one
    (possibly short) block is one sum, with no pad to the block's width first."""
    from dlm_engine.core.blockwise import block_counts
    from dlm_engine.core.instrument import SyncCounter

    g = torch.Generator().manual_seed(G * 100 + bl)
    canvas = Canvas.from_prompts([[5, 6, 7], [8]], G, 99, 0)
    canvas.step_of[:, canvas.gen_start:] = torch.where(torch.rand((2, G), generator=g) < 0.5, -1, 1)
    m = canvas.step_of[:, canvas.gen_start:] < 0
    want = [[int(m[r, b:b + bl].sum()) for b in range(0, G, bl)] for r in range(2)]
    with SyncCounter() as sc:
        got = block_counts(canvas, bl, m)
    assert got.tolist() == want and got.dtype == torch.long
    if G <= bl:
        assert sc.ops == 1
