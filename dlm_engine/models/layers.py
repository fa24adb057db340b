"""Hooked transformer pieces shared by every model family (LLaDA, Dream, ...).

A family supplies its projections, its RoPE rotation and a few flags (:class:`AttentionSpec`); the code
here runs them inside the cache hooks of :mod:`dlm_engine.core.protocol`: only the columns a cache selects go
through the Q/K/V projections and the FFN, keys/values come from ``hooks.keys_values``, the attention mask
covers padding, block-causal blocks and auxiliary columns, and the logits of a window are assembled from
whichever hidden states were computed (with the family's logit shift) together with a validity mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dlm_engine.core.protocol import (AttentionIO, CallRequest, Columns, FFNIO, ForwardCall, key_padding_mask,
                                     soft_embed)


class RMSNorm(nn.Module):
    """RMS norm computed in float32; the weight is applied after casting back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [B, 1, T, head_dim] (rotate-half convention, float32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float) / head_dim))
    freqs = position_ids.to(torch.float)[..., None] * inv_freq
    ang = torch.cat((freqs, freqs), dim=-1)[:, None]
    return ang.cos(), ang.sin()


def rotate_half(t: torch.Tensor) -> torch.Tensor:
    x1, x2 = t.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_float32(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE computed in float32 and cast back (LLaDA)."""
    tf = t.float()
    return (tf * cos + rotate_half(tf) * sin).to(t.dtype)


def rope_native(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the tensor's own dtype, cos/sin already cast (Qwen2 / Dream)."""
    return (t * cos) + (rotate_half(t) * sin)


def take_cols(t: torch.Tensor, cols: Optional[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """``t`` restricted to ``cols`` ([B, Q] column indices along ``dim``); ``t`` itself when ``cols`` is None."""
    if cols is None:
        return t
    shape = [1] * t.dim()
    shape[0], shape[dim] = cols.shape
    idx = cols.view(shape).expand(*[t.shape[i] if i not in (0, dim) else cols.shape[0 if i == 0 else 1]
                                    for i in range(t.dim())])
    return torch.gather(t, dim, idx)


@dataclass
class AttentionSpec:
    """What differs between families in one attention layer."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    zero_padding_queries: bool = False     # Dream: a padding query's output is 0 (its reference masks queries too)


def _heads(t: torch.Tensor, n: int, d: int) -> torch.Tensor:
    B, T, _ = t.shape
    return t.view(B, T, n, d).transpose(1, 2)


def call_columns(call: ForwardCall) -> torch.Tensor:
    """``[B, T]`` column id of every position of the call's residual stream (aux columns are ``L + i``)."""
    memo = call.memo
    if "cols" not in memo:
        B, L = call.input_ids.shape
        cols = call.columns.canvas_ids(B, call.input_ids.device)
        aux = call.request.aux
        if aux is not None:
            W = aux.tokens.shape[1]
            cols = torch.cat([cols, torch.arange(L, L + W, device=cols.device).expand(B, W)], dim=1)
        memo["cols"] = cols
    return memo["cols"]


def attention_mask(call: ForwardCall, q_cols: torch.Tensor, k_cols: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Boolean mask ``[B or 1, 1, Q, K]`` (True = may attend) or None when nothing is masked.

    ``q_cols``: ``[B, Q]`` column ids of the queries; ``k_cols``: ``[K]`` or ``[B, K]`` of the keys (None =
    the queries themselves). Padding keys are masked, block-causal models see no later block (blocks count
    from the generation start -- the prompt is block -1 -- or from ``call.block_origin``), and auxiliary columns
    use their own mask.
    """
    if k_cols is None:
        k_cols = q_cols
    aux = call.request.aux
    if aux is not None:
        B = q_cols.shape[0]
        kc = k_cols if k_cols.dim() == 2 else k_cols.expand(B, -1)
        m = aux.attend.gather(1, q_cols[:, :, None].expand(-1, -1, aux.attend.shape[2]))
        return m.gather(2, kc[:, None, :].expand(-1, q_cols.shape[1], -1))[:, None]
    mask = None
    if call.key_mask is not None:
        km = call.key_mask
        mask = (km[:, k_cols] if k_cols.dim() == 1 else km.gather(1, k_cols))[:, None, None, :]
    if call.attention_mode == "block_causal":
        size = int(call.block_size or 0)
        if size <= 0:
            raise ValueError("block_causal attention needs a block size (config.block_causal_size)")
        origin = call.gen_start if call.block_origin is None else int(call.block_origin)

        def block_id(c: torch.Tensor) -> torch.Tensor:
            return torch.where(c < origin, torch.full_like(c, -1), torch.div(c - origin, size, rounding_mode="floor"))

        kb = block_id(k_cols)
        kb = kb[None, None, :] if kb.dim() == 1 else kb[:, None, :]
        bc = (kb <= block_id(q_cols)[:, :, None])[:, None]
        d = call.directive
        ks = int(d.key_start) if d is not None else 0
        if ks > 0:          # columns before key_start are seen by no query at or after it (a reference quirk)
            kc = k_cols[None, None, :] if k_cols.dim() == 1 else k_cols[:, None, :]
            bc = bc & ((kc >= ks) | (q_cols[:, :, None] < ks))[:, None]
        mask = bc if mask is None else (mask & bc)
    return mask


def _memo_mask(call: ForwardCall, q_cols, k_cols, sel) -> Optional[torch.Tensor]:
    """The mask of a layer; layers with the same query columns and key columns share one (built once per call)."""
    key = ("mask", None if sel is None else id(sel), None if k_cols is None else id(k_cols))
    memo = call.memo
    if key not in memo:
        memo[key] = (attention_mask(call, q_cols, k_cols), sel, k_cols)   # keep the tensors alive (stable ids)
    return memo[key][0]


def attend(q, k, v, mask: Optional[torch.Tensor], need_weights: bool):
    """Multi-head attention ``[B, H, Q, D]``; with ``need_weights`` an explicit softmax (float32, additive
    ``finfo.min`` mask as eager attention does) that also returns the head-averaged weights ``[B, Q, K]``."""
    if not need_weights:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False), None
    scores = torch.matmul(q, k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
    if mask is not None:
        scores = scores + (~mask).to(scores.dtype) * torch.finfo(scores.dtype).min
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v), p.mean(dim=1)


def attention_block(idx: int, x: torch.Tensor, norm: nn.Module, spec: AttentionSpec, out_proj: nn.Module,
                    rope: Tuple[torch.Tensor, torch.Tensor], call: ForwardCall, hooks) -> torch.Tensor:
    """``x + out_proj(attention(norm(x)))`` with the projections inside ``hooks.attention``."""
    B, T, _ = x.shape
    a = norm(x)
    io = AttentionIO(layer=idx, x=a, call=call, out_proj=out_proj,
                     project_v=lambda t: _heads(spec.v_proj(t), spec.n_kv_heads, spec.head_dim))
    with hooks.attention(idx, io) as io:
        sel = io.query_cols
        xs = take_cols(a, sel)
        q = _heads(spec.q_proj(xs), spec.n_heads, spec.head_dim)
        k = _heads(spec.k_proj(xs), spec.n_kv_heads, spec.head_dim)
        v = _heads(spec.v_proj(xs), spec.n_kv_heads, spec.head_dim)
        cos, sin = (take_cols(t, sel, dim=2) for t in rope)
        q, k = spec.rope(q, cos, sin), spec.rope(k, cos, sin)
        kk, vv, k_cols = hooks.keys_values(idx, io, k, v)
        if spec.n_kv_heads != spec.n_heads:
            rep = spec.n_heads // spec.n_kv_heads
            kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
        masked = call.key_mask is not None or call.attention_mode != "bidirectional" or call.request.aux is not None
        q_cols = take_cols(call_columns(call), sel) if masked else None
        mask = _memo_mask(call, q_cols, k_cols, sel) if masked else None
        out, io.weights = attend(q, kk, vv, mask, io.need_weights)
        if spec.zero_padding_queries and call.key_mask is not None:
            km = call.key_mask
            if call.request.aux is not None:                            # aux columns are never padding
                km = torch.cat([km, torch.ones_like(call.request.aux.tokens, dtype=torch.bool)], dim=1)
            out = out * km.gather(1, q_cols)[:, None, :, None].to(out.dtype)
        io.out = out.transpose(1, 2).reshape(B, q.shape[2], spec.n_heads * spec.head_dim)   # (also with 0 columns)
        io.key_columns = k_cols
        call.layer_positions += B * q.shape[2]
    if io.out.shape[1] != T:
        raise RuntimeError(f"cache hook left attention output for {io.out.shape[1]} of {T} positions in layer {idx}")
    return x + (io.out if io.projected else out_proj(io.out))


def ffn_block(idx: int, x: torch.Tensor, norm: nn.Module, mlp: Callable[[torch.Tensor], torch.Tensor],
              call: ForwardCall, hooks) -> torch.Tensor:
    """``x + mlp(norm(x))`` with the FFN inside ``hooks.ffn`` (a cache may compute only some columns)."""
    fio = FFNIO(layer=idx, x=x, call=call)
    with hooks.ffn(idx, fio) as fio:
        fio.out = mlp(norm(take_cols(fio.x, fio.cols)))
    if fio.out.shape[1] != x.shape[1]:
        raise RuntimeError(f"cache hook left FFN output for {fio.out.shape[1]} of {x.shape[1]} positions in layer {idx}")
    return x + fio.out


def embed_call(call: ForwardCall, embed: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """Input embeddings and position ids of the call's residual stream (canvas columns, then aux columns)."""
    cols = call.columns
    ids, pos = cols.take(call.input_ids), cols.take(call.position_ids)
    aux = call.request.aux
    if aux is not None:
        ids, pos = torch.cat([ids, aux.tokens], dim=1), torch.cat([pos, aux.positions.to(pos.dtype)], dim=1)
    x = embed(ids)
    soft = call.request.soft
    if soft is not None:                 # the strategy's soft inputs at its chosen columns (protocol.SoftInputs)
        where = cols.take(soft.where)
        mixed = soft_embed(embed.weight, cols.take(soft.tokens), cols.take(soft.probs), soft.mask_id, soft.mix)
        n = where.shape[1]
        x = torch.cat([torch.where(where[..., None], mixed, x[:, :n]), x[:, n:]], dim=1) if aux is not None \
            else torch.where(where[..., None], mixed, x)
    return x, pos


def window_logits(call: ForwardCall, h: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], vocab: int) -> None:
    """Fill ``call.logits`` / ``call.valid`` (and ``call.aux_logits``) from the final hidden states ``h``
    (``[B, T, d]`` of the call's columns; ``head`` = final norm + output projection).

    Column ``j`` of the window reads hidden state ``max(j - shift, 0)``. For a span the head runs only on the
    hidden states the window needs (contiguous, each once); for per-row index sets it runs on the computed
    rows and the window is gathered from them, zeros (``valid`` False) where the source was not computed.
    """
    B = h.shape[0]
    lo, hi = call.logits_range
    shift = call.logits_shift
    cols = call.columns
    L = call.length
    n_canvas = cols.width
    if call.request.aux is not None:
        W = h.shape[1] - n_canvas
        i = torch.arange(W, device=h.device)
        src = L + ((i - shift).clamp_min(0) if call.request.aux.shift_within else i - shift)   # slot i <- hidden
        call.aux_logits = head(h[:, src - cols.start])              # aux requires the full canvas span
        h = h[:, :n_canvas]
    if hi <= lo:
        call.logits = h.new_zeros((B, 0, vocab))
        call.valid = None
        return
    if cols.is_span:
        s, e = cols.start, cols.end
        floor = call.shift_floor or 0                                  # column `floor` reads its own hidden state
        a, b = max(lo - shift, floor), max(hi - 1 - shift, floor) + 1  # the hidden states the window reads
        if s <= a and b <= e:                                           # all computed: the common case
            out = head(h[:, a - s:b - s])
            if b - a != hi - lo:                                       # column 0 of a shifted model reads hidden 0 twice
                out = torch.cat([out[:, :1], out], dim=1)
            call.logits, call.valid = out, None
            return
    j = torch.arange(lo, hi)
    src = (j - shift).clamp_min(call.shift_floor or 0)
    if cols.is_span:
        ok = (src >= s) & (src < e)
        out = h.new_zeros((B, hi - lo, vocab))
        if bool(ok.any()):
            sel = ok.nonzero().squeeze(1)
            a, b = int(src[sel[0]]), int(src[sel[-1]]) + 1
            part = head(h[:, a - s:b - s]).index_select(1, (src[sel] - a).to(h.device))
            out[:, sel.to(h.device)] = part.to(out.dtype)
        call.logits = out
        call.valid = ok.to(h.device)[None, :].expand(B, -1)
        return
    # per-row index sets: position of every canvas column in the call (-1 = not computed)
    index = cols.index
    where = torch.full((B, L), -1, dtype=torch.long, device=h.device)
    where.scatter_(1, index, torch.arange(index.shape[1], device=h.device).expand(B, -1))
    at = where[:, src.to(h.device)]                                  # [B, W]
    valid = at >= 0
    rows_h = head(h)                                                 # [B, Q, V]: every computed row once
    out = torch.gather(rows_h, 1, at.clamp_min(0)[:, :, None].expand(-1, -1, rows_h.shape[-1]))
    call.logits = out.masked_fill(~valid[:, :, None], 0)
    call.valid = valid


def run_layers(call: ForwardCall, hooks, embed: nn.Module, layers, head_dim: int, theta: float,
               head: Callable[[torch.Tensor], torch.Tensor], vocab: int, rope_in_model_dtype: bool) -> ForwardCall:
    """The body every family's ``forward`` shares: inside ``hooks.forward`` embed the call's columns, build the
    RoPE tables from their positions, run the layers and assemble the window's logits."""
    with hooks.forward(call) as call:
        x, pos = embed_call(call, embed)
        call.computed = int(x.shape[0] * x.shape[1])
        cos, sin = rope_tables(pos, head_dim, theta)
        if rope_in_model_dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in layers:
            x = layer(x, (cos, sin), call, hooks)
        window_logits(call, x, head, vocab)
    return call


def cumsum_positions(key_mask, B: int, L: int, device) -> torch.Tensor:
    """Position ids of LLaDA, LLaDA2 and the Qwen block-diffusion references: ``arange`` (``0..L-1``), or over a
    padding mask ``cumsum(mask) - 1`` (pads at 0). (Dream puts its pads at 1: its own function.)"""
    if key_mask is None:
        return torch.arange(L, device=device).expand(B, L)
    return (key_mask.long().cumsum(-1) - 1).clamp_min(0)


def new_call(input_ids, attention_mask, position_ids, logits_range, request, default_positions) -> ForwardCall:
    """The :class:`ForwardCall` a family's ``forward`` runs (positions from the mask when not given)."""
    B, L = input_ids.shape
    key_mask = key_padding_mask(attention_mask)
    if position_ids is None:
        position_ids = default_positions(key_mask, B, L, input_ids.device)
    return ForwardCall(input_ids=input_ids, position_ids=position_ids, key_mask=key_mask, columns=Columns.span(0, L),
                       logits_range=tuple(logits_range) if logits_range is not None else (0, L),
                       request=request if request is not None else CallRequest())
