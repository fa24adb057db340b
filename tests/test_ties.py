"""Exact ties: when candidates have exactly equal confidence at the top-k cut, every strategy picks the
positions its reference picks. ``torch.topk`` breaks ties depending on the row's length and on ``k``, so each
strategy must rank in the same row as its reference: LLaDA / Prophet / Fast-dLLM the model call's columns
(the whole canvas without a cache), the d2Cache family the generated part, WINO its window."""
import torch

from dlm_engine.core.canvas import Canvas
from dlm_engine.core.loop import decode
from dlm_engine.core.protocol import CallRequest, Columns, ForwardCall
from dlm_engine.core.registry import cache_class, strategy_class
from dlm_engine.app.sinks import RecordingSink

V, MASK, P, G = 12, 11, 3, 16
TIED = [2, 5, 6, 9, 13]             # generated positions with exactly the same (highest) confidence


class Tied:
    """Every generated position prefers token 4; the positions in ``TIED`` do so with the same, highest
    probability (bit-identical logits), the others less surely."""

    def __call__(self, ids, attention_mask=None, position_ids=None, hooks=None, logits_range=None, request=None):
        B, L = ids.shape
        lo, hi = logits_range or (0, L)
        logits = torch.zeros((B, hi - lo, V))
        logits[:, :, 4] = 2.0
        for j in range(lo, hi):
            if j - P in TIED:
                logits[:, j - lo, 4] = 3.0
        call = ForwardCall(input_ids=ids, position_ids=ids, key_mask=None, columns=Columns.span(0, L),
                           logits_range=(lo, hi), request=request or CallRequest(), logits=logits)
        if request is not None and request.aux is not None:
            call.aux_logits = torch.zeros((B, request.aux.tokens.shape[1], V))
        return call


def first_step(name, **kw):
    cls = strategy_class(name)
    canvas = Canvas.from_prompts([[1, 2, 3]], G, MASK, 0)
    rec = RecordingSink()
    decode(Tied(), canvas, cls(cls.Config(**kw), G), cache_class("none")(), sinks=[rec])
    d = rec.deltas[0]
    cols = d.commit[0].nonzero().squeeze(1) + d.start - P
    return sorted(cols.tolist())


def reference_pick(width, offset, k):
    """What ``torch.topk(row, k)`` picks in a row of ``width`` holding the tied positions at ``offset``."""
    row = torch.full((width,), float("-inf"))
    row[[offset + t for t in TIED]] = 1.0
    row[[offset + j for j in range(G) if j not in TIED]] = 0.5
    return sorted((torch.topk(row, k).indices - offset).tolist())


def test_the_tie_is_real():
    """The crafted row is one where torch.topk does not pick the lowest tied index: a strategy ranking in the
    wrong row would pick differently."""
    assert reference_pick(P + G, P, 1) != [TIED[0]] or reference_pick(G, 0, 1) != [TIED[0]]


def test_llada_low_confidence_ranks_in_the_whole_canvas_row():
    assert first_step("low_confidence") == reference_pick(P + G, P, 1)          # LLaDA generate: full row
    assert first_step("low_confidence", steps=8) == reference_pick(P + G, P, 2)


def test_fast_dllm_rules_rank_in_the_call_row():
    assert first_step("low_confidence", loop="fastdllm") == reference_pick(P + G, P, 1)
    # threshold: top-1 is the first of topk(row, |candidates|); nothing reaches 0.99
    top = torch.topk(_row(P + G, P), G).indices[0].item() - P
    assert first_step("threshold", threshold=0.99) == [top]
    assert first_step("early_exit") == reference_pick(P + G, P, 1)               # Prophet: LLaDA's row


def _row(width, offset):
    row = torch.full((width,), float("-inf"))
    row[[offset + t for t in TIED]] = 1.0
    row[[offset + j for j in range(G) if j not in TIED]] = 0.5
    return row


def test_d2cache_family_ranks_in_the_generated_row():
    assert first_step("d2c") == reference_pick(G, 0, 1)
    assert first_step("d2c", num_transfer_tokens=3) == reference_pick(G, 0, 3)
    assert first_step("klass") == reference_pick(G, 0, 1)                        # KLASS falls back to top-k


def test_wino_ranks_in_its_window():
    # wide-in: nothing reaches 0.99, so the top num_transfer_tokens slots of the window (the block) commit
    assert first_step("wino", wide_in_thres=0.99, block_length=G) == reference_pick(G, 0, 1)


def test_cadllm_ranks_in_the_call_row():
    # the adaptive threshold (0.85 at the block start) is out of reach: the top-1 of topk(row, |candidates|) commits
    top = torch.topk(_row(P + G, P), G).indices[0].item() - P
    assert first_step("cadllm", initial_block_length=G, min_block=G, max_block=G) == [top]


def test_padding_never_changes_a_pick():
    """In a left-padded batch each row is ranked without its padding: the pick of a batch of one."""
    cls = strategy_class("low_confidence")
    prompts = [[1, 2, 3], [1], [2, 3]]
    canvas = Canvas.from_prompts(prompts, G, MASK, 0)
    rec = RecordingSink()
    decode(Tied(), canvas, cls(cls.Config(), G), cache_class("none")(), sinks=[rec])
    d = rec.deltas[0]
    for r, p in enumerate(prompts):
        cols = sorted((d.commit[r].nonzero().squeeze(1) + d.start - P).tolist())
        assert cols == reference_pick(len(p) + G, len(p), 1), r
    # and the padded row would pick differently if it were ranked with its padding
    assert reference_pick(P + G, P, 1) != reference_pick(1 + G, 1, 1) or \
        reference_pick(P + G, P, 1) != reference_pick(2 + G, 2, 1)
