"""Fake models for tests: scripted per-column preferences, speaking the model protocol of
:mod:`dlm_engine.core.protocol` (window logits, the call's active rows)."""
import math

import torch

from dlm_engine.core.protocol import CallRequest, Columns, ForwardCall

V, MASK, EOS, EOT = 10, 9, 8, 7
P = 2  # prompt length


class Scripted:
    """Generation column j prefers ``top[j]`` with probability ``conf[j]``, then ``second[j]``: one script for
    every row, or one per canvas row when ``top`` is a list of lists (``CallRequest.rows`` says which canvas
    rows a call runs once some rows are finished). Records the batch size of every call in ``sizes``."""

    def __init__(self, top, conf, second):
        per_row = isinstance(top[0], (list, tuple))
        self.scripts = list(zip(top, conf, second)) if per_row else [(top, conf, second)]
        self.sizes = []

    @property
    def calls(self) -> int:
        return len(self.sizes)

    def __call__(self, ids, attention_mask=None, position_ids=None, hooks=None, logits_range=None, request=None):
        B, L = ids.shape
        self.sizes.append(B)
        lo, hi = logits_range or (0, L)
        logits = torch.full((B, hi - lo, V), -8.0)
        rows = request.rows if request is not None else None
        for b, r in enumerate(range(B) if rows is None else rows.tolist()):
            top, conf, second = self.scripts[min(r, len(self.scripts) - 1)]
            for j in range(lo, hi):
                if 0 <= j - P < len(top):
                    logits[b, j - lo, top[j - P]] = math.log(conf[j - P])
                    logits[b, j - lo, second[j - P]] = math.log((1 - conf[j - P]) * 0.9)
        return ForwardCall(input_ids=ids, position_ids=position_ids, key_mask=None, columns=Columns.span(0, L),
                           logits_range=(lo, hi), request=request or CallRequest(), logits=logits)


class CommittedDeltas:
    """A sink keeping what every delta committed: ``(commit, tokens there, confidences there)`` (the rest of a
    delta's tokens and confidences is nobody's business: sinks record the committed positions only)."""

    wants_logits = wants_recomputed = False

    def __init__(self):
        self.seen = []

    def on_start(self, canvas, info):
        pass

    def on_delta(self, delta, canvas):
        c = delta.confidence
        self.seen.append((delta.commit.tolist(), torch.where(delta.commit, delta.tokens, 0).tolist(),
                          None if c is None else torch.where(delta.commit, c, torch.zeros_like(c)).tolist()))

    def on_end(self, canvas):
        pass


HOST_COUNT_PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16]]


def host_counts_checked(model, cls, config, cache: str, recount, read_commits):
    """Decode ``HOST_COUNT_PROMPTS`` (16 positions, padded batch of 3) with a subclass of ``cls`` that compares,
    after every step's host read, the counts the strategy keeps on the host with ``recount(strategy, canvas)``;
    returns ``[(read_commits(strategy, canvas, state_before), counts equal), ...]`` per host read."""
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import cache_class

    checked = []

    class Checked(cls):
        def synced(self, canvas, st, values, delta):
            used = read_commits(self, canvas, st)
            out = super().synced(canvas, st, values, delta)
            checked.append((used, out.counts == tuple(map(tuple, recount(self, canvas).tolist()))))
            return out

    canvas = Canvas.from_prompts(HOST_COUNT_PROMPTS, 16, int(model.config.mask_token_id), 0,
                                 eos_id=int(model.config.eos_token_id))
    with torch.inference_mode():
        decode(model, canvas, Checked(config, 16), cache_class(cache)())
    return checked
