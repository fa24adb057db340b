"""Fake models for tests: chosen logits at any vocabulary and batch, speaking the model protocol of
:mod:`dlm_engine.core.protocol` through the real cache hooks (:class:`ScriptedModel`; scripts:
:func:`preferring`, :func:`random_script`; :class:`Scripted` is the small-vocabulary preset of older tests)."""
import math

import torch
import torch.nn as nn

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.loop import Sink
from dlm_engine.core.protocol import NullHooks, soft_embed
from dlm_engine.models.layers import (AttentionSpec, attention_block, call_columns, ffn_block, new_call, rope_native,
                                     rope_tables, window_logits)

V, MASK, EOS, EOT = 10, 9, 8, 7
P = 2  # prompt length


class CommittedDeltas(Sink):
    """A sink keeping what every delta committed: ``(commit, tokens there, confidences there)`` (the rest of a
    delta's tokens and confidences is nobody's business: sinks record the committed positions only)."""

    def __init__(self):
        self.seen = []

    def on_delta(self, delta, canvas):
        c = delta.confidence
        self.seen.append((delta.commit.tolist(), torch.where(delta.commit, delta.tokens, 0).tolist(),
                          None if c is None else torch.where(delta.commit, c, torch.zeros_like(c)).tolist()))


class FakeConfig:
    """The config attributes the engine reads from a model."""

    def __init__(self, vocab: int, mask_id: int, eos_id: int, model_type: str):
        self.vocab_size = self.embedding_size = vocab
        self.mask_token_id, self.eos_token_id, self.model_type = mask_id, eos_id, model_type


class ScriptedModel:
    """A model-free fake at any vocabulary size and batch: the logits of canvas row ``r``, column ``j`` are
    ``script(rows, cols, tokens, vocab)`` (``[N]`` long tensors in, ``[N, vocab]`` out; ``tokens`` = what the
    canvas holds at ``j`` now), whatever the cache does.

    It runs the real hooked layers of :mod:`dlm_engine.models.layers` (``layers`` of them, random Q/K/V with a
    fixed seed), so a cache narrows columns, stores and merges keys/values, takes attention weights and keeps
    FFN outputs exactly as with a checkpoint; but every layer adds zero to the residual stream (zero output
    projection and FFN), which carries (token, canvas column, canvas row) to the head, so the logits are the
    script's at every column the call computed (``valid``). ``shift=1`` is a shifted-logit model (Dream): column
    ``j``'s logits come from hidden state ``j - 1`` and are still column ``j``'s script. Counts calls and their
    batch sizes (``sizes``), positions fed into the layers (``computed``) and query positions the attention
    layers projected (``layer_positions``: fewer when a cache recomputes some positions per layer)."""

    def __init__(self, script, vocab: int, mask_id: int = None, eos_id: int = None, layers: int = 2,
                 shift: int = 0, model_type: str = "scripted", d: int = 16, heads: int = 2):
        self.script, self.vocab, self.logits_shift = script, vocab, shift
        mask_id = vocab - 1 if mask_id is None else mask_id
        eos_id = vocab - 2 if eos_id is None else eos_id
        self.config = FakeConfig(vocab, mask_id, eos_id, model_type)
        g = torch.Generator().manual_seed(0)
        self._embed = torch.randn(vocab, d - 3, generator=g)
        self._d, self._heads = d, heads
        self._layers = []
        for _ in range(layers):
            q, k, v = (nn.Linear(d, d, bias=False) for _ in range(3))
            for lin in (q, k, v):
                lin.weight.data = torch.randn(d, d, generator=g) / d ** 0.5
            out = nn.Linear(d, d, bias=False)
            out.weight.data.zero_()
            spec = AttentionSpec(q, k, v, heads, heads, d // heads, rope_native)
            self._layers.append((spec, out))
        self.sizes, self.computed, self.layer_positions, self.soft_calls = [], 0, 0, 0

    # takes a strategy's soft inputs (CallRequest.soft) into its embedding channels; its logits stay the script's
    offers = caps(Cap.SOFT_INPUTS)

    @property
    def calls(self) -> int:
        return len(self.sizes)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, hooks=None, logits_range=None,
                 request=None):
        def positions(key_mask, B, L, device):
            if key_mask is None:
                return torch.arange(L, device=device).expand(B, L)
            return (key_mask.long().cumsum(1) - 1).clamp_min(0)

        hooks = NullHooks() if hooks is None else hooks
        call = new_call(input_ids, attention_mask, position_ids, logits_range, request, positions)
        call.logits_shift = self.logits_shift
        B, L = input_ids.shape
        self.sizes.append(B)
        req = call.request
        with hooks.forward(call) as call:
            cols = call_columns(call)                                            # [B, T]
            ids = call.columns.take(call.input_ids)
            pos = call.columns.take(call.position_ids)
            if req.aux is not None:
                ids = torch.cat([ids, req.aux.tokens], 1)
                pos = torch.cat([pos, req.aux.positions.to(pos.dtype)], 1)
            batch_row = torch.arange(B)[:, None].expand_as(cols)
            emb = self._embed[ids]
            if req.soft is not None:      # soft inputs enter the embedding channels (the script reads the token's)
                sw = call.columns.take(req.soft.where)
                mixed = soft_embed(self._embed, call.columns.take(req.soft.tokens), call.columns.take(req.soft.probs),
                                   req.soft.mask_id, req.soft.mix)
                n = sw.shape[1]
                emb = torch.cat([torch.where(sw[..., None], mixed, emb[:, :n]), emb[:, n:]], dim=1)
                self.soft_calls += 1
            x = torch.cat([ids[..., None].float(), cols[..., None].float(), batch_row[..., None].float(), emb], dim=-1)
            self.computed += x.shape[0] * x.shape[1]
            call.computed = int(x.shape[0] * x.shape[1])
            rope = rope_tables(pos, self._d // self._heads, 10000.0)
            norm = torch.nn.Identity()
            for i, (spec, out) in enumerate(self._layers):
                x = attention_block(i, x, norm, spec, out, rope, call, hooks)
                x = ffn_block(i, x, norm, torch.zeros_like, call, hooks)
            window_logits(call, x, self._head(call), self.vocab)
        self.layer_positions += call.layer_positions
        return call

    def _head(self, call):
        """Final hidden states -> the script's logits for the column each predicts (aux columns: the token
        they hold stands for the canvas')."""
        shift, (B, L) = self.logits_shift, call.input_ids.shape
        canvas_row = torch.arange(B) if call.request.rows is None else call.request.rows

        def head(h):
            flat = h.reshape(-1, h.shape[-1])
            b = flat[:, 2].round().long()
            col = flat[:, 1].round().long() + shift                              # the column these logits predict
            held = call.input_ids[b, col.clamp_max(L - 1)]
            tokens = torch.where(col < L, held, flat[:, 0].round().long())
            out = self.script(canvas_row[b], col, tokens, self.vocab)
            return out.to(torch.float32).reshape(*h.shape[:-1], self.vocab)

        return head


def preferring(top, conf, second=None, floor: float = -8.0):
    """A script from per-column preferences (as :class:`Scripted`): generation column ``j`` of canvas row ``r``
    prefers ``top[r][j]`` with probability ``conf[r][j]`` (``top``/``conf``: ``[R, G]`` tensors or lists; the
    last row's script serves rows beyond it), then ``second`` (default: token 0) with 90% of the rest; every
    other logit is ``floor``. Returns ``at(gen_start)``, which gives the script for a canvas whose generation
    starts at column ``gen_start``."""
    top, conf = torch.as_tensor(top), torch.as_tensor(conf, dtype=torch.float32)
    if top.dim() == 1:
        top, conf = top[None], conf[None]
    second = torch.zeros_like(top) if second is None else torch.as_tensor(second).reshape(top.shape)

    def at(gen_start: int):
        def script(rows, cols, tokens, vocab):
            out = torch.full((len(rows), vocab), floor)
            j = cols - gen_start
            ok = (j >= 0) & (j < top.shape[1])
            r, j = rows.clamp_max(top.shape[0] - 1), j.clamp(0, top.shape[1] - 1)
            n = torch.arange(len(rows))[ok]
            out[n, top[r, j][ok]] = conf[r, j][ok].log()
            out[n, second[r, j][ok]] = ((1 - conf[r, j][ok]) * 0.9).clamp_min(1e-12).log()
            return out
        return script

    return at


def random_script(seed: int = 0, by_row: bool = False):
    """Pseudo-random logits, a function of the column and the token it holds (and of the canvas row with
    ``by_row``): the same wherever and whenever a column is computed, at any vocabulary and length. Each column
    has one preferred token (never the last two ids, the default mask and EOS) whose probability is spread over
    about 5%..98%, over noise on the rest (one of 61 fixed noise rows)."""
    tables = {}

    def frac(x):
        return x - x.floor()

    def script(rows, cols, tokens, vocab):
        if vocab not in tables:
            tables[vocab] = 2 * torch.rand(61, vocab, generator=torch.Generator().manual_seed(seed))
        key = cols.double() * 7.31 + tokens.double() * 0.013 + (rows.double() * 3.17 if by_row else 0) + seed * 1.7
        h1, h2 = frac(torch.sin(key * 12.9898) * 43758.5453), frac(torch.sin(key * 4.1414) * 24634.6345)
        out = tables[vocab][(h2 * 61).long().clamp_max(60)].clone()
        top = (h1 * (vocab - 2)).long().clamp_max(vocab - 3)
        out[torch.arange(len(cols)), top] = (math.log(2.0 * vocab) + (-3 + 7 * h2)).float()   # ~ sigmoid(-3..4)
        return out

    return script


class Scripted(ScriptedModel):
    """Generation column j (the prompt is ``P`` columns) prefers ``top[j]`` with probability ``conf[j]``, then
    ``second[j]``: one script for every row, or one per canvas row when ``top`` is a list of lists (a call that
    runs some rows gets theirs). Vocabulary ``V``, mask ``MASK``, EOS ``EOS``."""

    def __init__(self, top, conf, second):
        super().__init__(preferring(top, conf, second)(P), V, mask_id=MASK, eos_id=EOS)
