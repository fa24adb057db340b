#!/usr/bin/env python3
"""Block-diffusion decoding: dlm_engine against a reference-shaped loop of each family, and the block store.

    python experiments/bench_block_diffusion.py                 # fdv2, sdar, llada2, default sizes (~20 s a round)
    python experiments/bench_block_diffusion.py --family sdar --prompt 256 --gen 256 --reps 5
    python experiments/bench_block_diffusion.py --family fdv2,sdar --store-table   # + cache=none vs block_kv

A random d256-class model of each family decodes one prompt with its family's parity settings (the settings
``experiments/parity.py`` uses against the bdparity fixtures): Fast-dLLM v2 ``fdv2`` (blocks of 32, sub-blocks of
8, threshold 0.9; cache ``block_kv``; again with ``use_block_cache``, the reference's stale block cache), SDAR
``sdar`` (eval sampler, blocks of 4, 4 denoising steps, top_k 1, threshold 0.9; cache ``block_kv``), LLaDA2.0
``llada2`` (blocks of 32, 32 steps, threshold 0.9; cache ``none``, as the reference recomputes everything, and also
``block_store``). The Qwen models are hidden 256, 4 layers, 4 heads / 2 KV heads, vocabulary 2048; the LLaDA2
model is experiments/bench_moe.py's MoE config (hidden 256, 4 layers, 64 experts, top-8) on the same vocabulary.
The output head is scaled (6/sqrt(d)); the mask and EOS rows are zeroed.

The **reference-shaped loop** of a family (``ref_fdv2``, ``ref_sdar``, ``ref_llada2``) is written here from the
SPEC of tests/fixtures/bdparity/README.md, in the shape of the reference's own decode loop: its own forwards over
the model's weights (a per-layer ``past_key_values`` list grown by concatenation for Fast-dLLM v2 and SDAR, a full
recompute of the window with an additive block mask for LLaDA2.0), its own per-step selection in plain torch. It
is not the references' code (not available here) and uses nothing of dlm_engine's loop, strategies or caches. Both
sides run interleaved (``--reps`` rounds after a warm-up); reported per dlm_engine cache: median process CPU and
wall time of each side, their ratio (reference / dlm_engine: above 1 means dlm_engine is faster), NFE of both and
whether the answers (the sequence each reference returns) and NFE are the same.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import List, Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dlm_engine.core.canvas import Canvas  # noqa: E402
from dlm_engine.core.loop import decode  # noqa: E402
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class  # noqa: E402
from dlm_engine.models.qwen_bd import FastDLLMv2Config, FastDLLMv2Model, SDARConfig, SDARModel  # noqa: E402

VOCAB, BOS, MASK, EOS = 2048, 1900, 1922, 1901      # (EOS is never proposed: its head row is zeroed)
FAMILIES = {
    "fdv2": (FastDLLMv2Config, FastDLLMv2Model, "fdv2",
             dict(block_size=32, small_block_size=8, threshold=0.9, decode_mask_block=None)),
    "sdar": (SDARConfig, SDARModel, "sdar",
             dict(block_length=4, denoising_steps=4, top_k=1, threshold=0.9, stop_ids=[])),
}


def build(family: str, hidden: int = 256, layers: int = 4, head_scale: float = 6.0, seed: int = 0):
    cfg_cls, model_cls, _, _ = FAMILIES[family]
    kw = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, bos_token_id=BOS, eos_token_id=EOS, mask_token_id=MASK)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, head_scale / hidden ** 0.5)
        model.lm_head.weight[MASK].zero_()
        model.lm_head.weight[EOS].zero_()
    return model.eval()


@contextmanager
def counting(cache):
    """Positions fed through the layers by every model call (``ForwardCall.computed``)."""
    sizes = []
    inner = cache.forward

    @contextmanager
    def forward(call):
        with inner(call) as c:
            yield c
        sizes.append(int(c.computed))

    cache.forward = forward
    yield sizes


def run(model, family: str, cache_name: str, prompt, gen: int):
    _, _, sname, kw = FAMILIES[family]
    S = strategy_class(sname)
    C = cache_class(cache_name)
    cache = C(C.Config())
    canvas = Canvas.from_prompts([prompt], gen, MASK, EOS, eos_id=EOS)
    with counting(cache) as sizes:
        torch.manual_seed(0)
        c0, w0 = time.process_time(), time.perf_counter()
        decode(model, canvas, S(S.Config(**kw), gen), cache=cache)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return dict(nfe=canvas.nfe, cpu=cpu, wall=wall, tokens=canvas.tokens.tolist(),
                per_step=sum(sizes) / max(1, len(sizes)), masked=int(canvas.masked().sum()))


# ------------------------------------------------------------------------------------------------------------------
# Reference-shaped loops. Each decodes the way its reference's own loop is structured, written here from the SPEC
# of tests/fixtures/bdparity/README.md (not the references' code, which is not on this machine): the reference's
# own forwards with a per-layer ``past_key_values`` list of (key, value) tensors grown by concatenation (Fast-dLLM
# v2, SDAR) or no cache at all (LLaDA2.0, which recomputes the window every step), and its per-step selection in
# plain torch. Nothing of dlm_engine's loop, strategies, FrameDelta or caches is used; only the model's weights and
# its leaf modules (Linear, RMSNorm, the SwiGLU experts), so the weights are identical.
# ------------------------------------------------------------------------------------------------------------------

def _rope_tables(pos: torch.Tensor, theta: float, dim: int, dtype) -> tuple:
    """cos / sin [q, dim] of the positions ``pos`` [q] (computed once per forward, as the model's rotary module)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    f = pos.to(torch.float)[:, None] * inv
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half) on the first ``cos.shape[-1]`` channels of ``x`` [B, H, q, hd]; the rest pass."""
    dim = cos.shape[-1]
    r = x[..., :dim]
    half = dim // 2
    r = r * cos + torch.cat((-r[..., half:], r[..., :half]), dim=-1) * sin
    return r if dim == x.shape[-1] else torch.cat((r, x[..., dim:]), dim=-1)


def _attend(q, k, v, mask):
    """SDPA with the key/value heads repeated for GQA (as ``repeat_kv`` does)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def qwen_forward(model, ids: torch.Tensor, pos0: int, past: list, store: bool, mask: Optional[torch.Tensor],
                 block_cache: Optional[list] = None, sub: Optional[int] = None):
    """One forward of a Fast-dLLM v2 / SDAR model: ``ids`` [B, q] at positions ``pos0..``, attending to ``past``
    (per layer ``(k, v)`` [B, KV, C, hd] or None) plus its own keys; ``store`` appends them to ``past``. ``mask``:
    boolean [q, C + q] (True = visible) or None (every key visible). Returns the raw logits [B, q, V].

    Fast-dLLM v2's block cache: with ``block_cache`` (a per-layer list) and ``sub`` None, the forward's own keys and
    values become the layer's block cache; with ``sub = r`` they overwrite its slots ``r..r+q-1`` in place and the
    queries attend to ``past`` plus every block-cache slot (stale ones included)."""
    m, cfg = model.model, model.config
    B, q = ids.shape
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = m.embed_tokens(ids)
    cos, sin = _rope_tables(torch.arange(pos0, pos0 + q), cfg.rope_theta, hd, h.dtype)
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        qs, ks, vs = a.q_proj(x).view(B, q, H, hd), a.k_proj(x).view(B, q, KV, hd), a.v_proj(x).view(B, q, KV, hd)
        if model.qk_norm:
            qs, ks = a.q_norm(qs), a.k_norm(ks)
        qs, ks, vs = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
        qs, ks = _rope(qs, cos, sin), _rope(ks, cos, sin)
        if block_cache is not None:
            if sub is None:
                block_cache[i] = (ks, vs)
            else:
                block_cache[i][0][:, :, sub:sub + q] = ks
                block_cache[i][1][:, :, sub:sub + q] = vs
                ks, vs = block_cache[i]
        if past[i] is not None:
            ks, vs = torch.cat((past[i][0], ks), dim=2), torch.cat((past[i][1], vs), dim=2)
        if store:
            past[i] = (ks, vs)
        o = _attend(qs, ks, vs, mask)
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, q, H * hd))
        x = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    return model.lm_head(m.norm(h))


def _block_causal(q0: int, q: int, k: int, block: int) -> torch.Tensor:
    """Query at absolute position a sees key c iff a // block >= c // block (keys from position 0)."""
    qa = torch.arange(q0, q0 + q)[:, None] // block
    return qa >= (torch.arange(k)[None, :] // block)


def ref_fdv2(model, prompt: List[int], max_new_tokens: int, mask_id: int, stop_token: int, block_size: int = 32,
             small_block_size: int = 8, threshold: float = 0.9, decode_mask_block: int = 32,
             use_block_cache: bool = False):
    """Fast-dLLM v2's ``generate`` (SPEC §3-§4, greedy): ``(returned row, NFE)``."""
    bs, sbs, stop = block_size, small_block_size, stop_token
    x = torch.tensor([prompt])
    P = x.shape[1]
    past = [None] * len(model.model.layers)
    nfe = 0
    if P > bs:                                                   # prefill the prompt's whole blocks
        n = P // bs * bs
        logits = qwen_forward(model, x[:, :n], 0, past, True, _block_causal(0, n, n, bs))
        nfe += 1
        if P % bs == 0:                                          # the AR token
            x = torch.cat((x, logits[:, -1].argmax(-1, keepdim=True)), dim=1)

    def settled(start):
        hit = (x[0, start:] == stop).nonzero()
        return bool(len(hit)) and not bool((x[0, start:start + int(hit[0])] == mask_id).any())

    for _ in range(max_new_tokens // bs):
        if bool((x[0, P:] == stop).any()):
            break
        start = x.shape[1]
        x = torch.cat((x, torch.full((1, bs - start % bs), mask_id)), dim=1)
        S = x.shape[1] - bs
        C = 0 if past[0] is None else past[0][0].shape[2]
        block_cache = [None] * len(past) if use_block_cache else None
        for j in range(bs // sbs):
            lo, hi = S + j * sbs, S + (j + 1) * sbs
            while bool((x[0, lo:hi] == mask_id).any()) and not settled(start):
                if use_block_cache and block_cache[0] is not None and not bool((x[:, lo] == mask_id).any()):
                    logits = qwen_forward(model, x[:, lo:hi], C + j * sbs, past, False, None, block_cache, j * sbs)
                    nfe += 1
                    logits = torch.cat((logits[:, :1], logits[:, :-1]), dim=1)
                else:
                    logits = qwen_forward(model, x[:, S:], C, past, False,
                                          _block_causal(C, bs, C + bs, decode_mask_block), block_cache)
                    nfe += 1
                    logits = torch.cat((logits[:, :1], logits[:, :-1]), dim=1)[:, j * sbs:(j + 1) * sbs]
                p = torch.softmax(logits.float(), dim=-1)
                conf, tok = p.max(dim=-1)
                masked = x[:, lo:hi] == mask_id
                conf = torch.where(masked, conf, torch.full_like(conf, float("-inf")))
                commit = conf > threshold
                commit[torch.arange(1), conf.argmax(dim=-1)] = True
                commit &= masked
                x[:, lo:hi] = torch.where(commit, tok, x[:, lo:hi])
        if settled(start):
            continue
        logits = qwen_forward(model, x[:, S:], C, past, True, _block_causal(C, bs, C + bs, bs))   # store
        nfe += 1
        x = torch.cat((x, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    row = x[0].tolist()
    gen = row[P:]
    return (row[:P + gen.index(stop) + 1] if stop in gen else row), nfe


def ref_sdar(model, prompt: List[int], gen_length: int, mask_id: int, block_length: int = 4,
             denoising_steps: int = 4, temperature: float = 1.0, top_k: int = 1, threshold: float = 0.9,
             stopping_criteria_idx=()):
    """SDAR's evaluation sampler (``block_diffusion_generate``, SPEC §2-§3, ``low_confidence``): ``(x, NFE)``."""
    B, S_ = block_length, denoising_steps
    P = len(prompt)
    N = -(-(P + gen_length) // B)
    x = torch.tensor([prompt + [mask_id] * (N * B - P)])
    past = [None] * len(model.model.layers)
    nfe = 0
    F_ = P // B * B
    if F_ > 0:
        qwen_forward(model, x[:, :F_], 0, past, True, None if F_ == B else _block_causal(0, F_, F_, B))
        nfe += 1
    assert B % S_ == 0
    n_k = [B // S_ + (1 if i < B % S_ else 0) for i in range(S_)]
    for b in range(P // B, N):
        s, e = b * B, (b + 1) * B
        for i in range(S_ + 1):
            block = x[:, s:e]
            masked = block == mask_id
            if not bool(masked.any()):
                qwen_forward(model, block, s, past, True, None)              # store the finished block
                nfe += 1
                break
            logits = qwen_forward(model, block, s, past, False, None)
            nfe += 1
            torch.rand_like(logits, dtype=torch.float64)                     # the (unused) Gumbel draw
            assert temperature > 0
            scaled = logits / temperature if temperature != 1 else logits
            p_full = torch.softmax(scaled, dim=-1)
            if top_k > 0:
                kth = scaled.topk(top_k, dim=-1).values[..., -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            probs = torch.softmax(scaled, dim=-1)
            x0 = torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(1, B)
            p = p_full.gather(-1, x0[..., None]).squeeze(-1)
            x0 = torch.where(masked, x0, block)
            conf = torch.where(masked, p, torch.full_like(p, float("-inf")))
            over = conf > threshold
            if threshold < 1 and int(over.sum()) >= n_k[i]:
                transfer = over
            else:
                transfer = torch.zeros_like(masked)
                transfer[0, conf[0].topk(n_k[i]).indices] = True
            x[:, s:e] = torch.where(transfer, x0, block)
        if any(bool((x[0, P:] == t).any()) for t in stopping_criteria_idx):
            break
    return x[0].tolist(), nfe


def _moe(mlp, x: torch.Tensor, cfg) -> torch.Tensor:
    """The LLaDA2 MoE layer of SPEC S2 on ``x`` [N, d]: fp32 sigmoid router, group-limited top-k on the biased
    scores, weights from the un-biased ones; each selected expert runs on its tokens, in ascending expert id."""
    N = x.shape[0]
    g = mlp.gate
    s = torch.sigmoid(x.float() @ g.weight.float().t())
    b = s + g.expert_bias
    grp = b.view(N, cfg.n_group, -1)
    gscore = grp.topk(2, dim=-1).values.sum(-1)
    drop = torch.ones_like(gscore, dtype=torch.bool)
    drop.scatter_(1, gscore.topk(cfg.topk_group, dim=-1).indices, False)
    b = b.masked_fill(drop[:, :, None].expand_as(grp).reshape(N, -1), float("-inf"))
    idx = b.topk(cfg.num_experts_per_tok, dim=-1).indices
    w = s.gather(1, idx)
    if cfg.num_experts_per_tok > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    out = x.new_zeros(N, idx.shape[1], x.shape[1])
    for e in idx.unique().tolist():                                         # ascending expert ids
        tok, slot = (idx == e).nonzero(as_tuple=True)
        out[tok, slot] = mlp.experts[e](x[tok])
    y = (out.float() * w[..., None]).sum(1).to(x.dtype)
    return y + mlp.shared_experts(x) if mlp.shared_experts is not None else y


def llada2_forward(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One LLaDA2 forward of ``ids`` [1, W] at positions 0..W-1 with the additive mask [1, 1, W, W] (no cache)."""
    m, cfg = model.model, model.config
    B, W = ids.shape
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = m.word_embeddings(ids)
    cos, sin = _rope_tables(torch.arange(W), cfg.rope_theta, cfg.rope_dim, h.dtype)
    for i, layer in enumerate(m.layers):
        a = layer.attention
        x = layer.input_layernorm(h)
        qkv = a.query_key_value(x).view(B, W, H + 2 * KV, hd)
        qs, ks, vs = qkv[:, :, :H], qkv[:, :, H:H + KV], qkv[:, :, H + KV:]
        qs, ks = a.query_layernorm(qs), a.key_layernorm(ks)
        qs, ks, vs = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
        qs, ks = _rope(qs, cos, sin), _rope(ks, cos, sin)
        o = _attend(qs, ks, vs, mask)
        h = h + a.dense(o.transpose(1, 2).reshape(B, W, H * hd))
        x = layer.post_attention_layernorm(h)
        if i < cfg.first_k_dense_replace:
            h = h + layer.mlp(x)
        else:
            h = h + _moe(layer.mlp, x.view(-1, x.shape[-1]), cfg).view_as(x)
    return model.lm_head(m.norm(h)).float()


def ref_llada2(model, prompt: List[int], gen_length: int, mask_id: int, eos_id: int, block_length: int = 32,
               steps: int = 32, threshold: float = 0.9, minimal_topk: int = 1):
    """LLaDA2.0's ``generate`` (SPEC S3, greedy, no ``eos_early_stop``): ``(returned generation, NFE)``."""
    P, bl = len(prompt), block_length
    steps = min(steps, gen_length // minimal_topk)
    NB = -(-(P + gen_length) // bl)
    x = torch.tensor([prompt + [mask_id] * (NB * bl - P)])
    blk = torch.arange(NB * bl) // bl
    dtype = next(model.parameters()).dtype
    full = torch.zeros(NB * bl, NB * bl, dtype=dtype).masked_fill(blk[None, :] > blk[:, None], float("-inf"))
    n_k = [bl // steps + (1 if s < bl % steps else 0) for s in range(steps)]
    nfe = 0
    for b in range(P // bl, NB):
        W = (b + 1) * bl
        for s in range(steps):
            masked = x[:, W - bl:W] == mask_id
            if not bool(masked.any()):
                break
            logits = llada2_forward(model, x[:, :W], full[None, None, :W, :W])[:, -bl:]
            nfe += 1
            p = torch.softmax(logits, dim=-1)
            c, x0 = p.max(dim=-1)
            conf = torch.where(masked, c, torch.full_like(c, float("-inf")))
            over = conf > threshold
            if int(over.sum()) >= n_k[s]:
                commit = over
            else:
                commit = torch.zeros_like(masked)
                commit[0, conf[0].topk(min(n_k[s], int(masked.sum()))).indices] = True
            x[:, W - bl:W] = torch.where(commit, x0, x[:, W - bl:W])
        if bool((x[0, P:W] == eos_id).any()):
            break
    ans = x[0, P:P + gen_length].tolist()
    return (ans[:ans.index(eos_id) + 1] if eos_id in ans else ans), nfe



# ------------------------------------------------------------------------------------------------------------------
# The comparison: the same model, the same prompt, the family's parity settings (experiments/parity.py's setups)
# ------------------------------------------------------------------------------------------------------------------

LLADA2_CONFIG = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.5,
                     num_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                     moe_intermediate_size=128, num_shared_experts=1, first_k_dense_replace=1, pad_token_id=EOS,
                     eos_token_id=EOS, mask_token_id=MASK, max_position_embeddings=4096, rope_theta=10000.0)
# (experiments/bench_moe.py's d256-class MoE config, on this script's vocabulary and ids)

SETTINGS = {      # family -> (strategy, its parity cache, the block store if that differs, strategy settings)
    "fdv2": ("fdv2", "block_kv", None, dict(block_size=32, small_block_size=8, threshold=0.9, stop_token=EOS)),
    "sdar": ("sdar", "block_kv", None, dict(block_length=4, denoising_steps=4, top_k=1, threshold=0.9,
                                            stop_ids=[])),
    "llada2": ("llada2", "none", "block_store", dict(block_length=32, steps=32, threshold=0.9)),
}


def build_model(family: str, hidden: int = 256, layers: int = 4, experts: int = 64, head_scale: float = 6.0,
                seed: int = 0):
    """The random d256-class model of a family (smaller with ``hidden`` / ``layers`` / ``experts``)."""
    if family != "llada2":
        return build(family, hidden, layers, head_scale, seed)
    from dlm_engine.models.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM

    kw = dict(LLADA2_CONFIG, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
              head_dim=hidden // 4, num_experts=experts, moe_intermediate_size=hidden // 2,
              num_experts_per_tok=min(8, experts // 2), n_group=min(8, experts // 2), topk_group=min(4, experts // 4))
    torch.manual_seed(seed)
    model = LLaDA2MoeModelLM(LLaDA2MoeConfig(**kw))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers[kw["first_k_dense_replace"]:]:
            gate = layer.mlp.gate                       # (spread the routing, as bench_moe does)
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) / hidden ** 0.5)
            gate.expert_bias.copy_(0.1 * torch.randn(gate.expert_bias.shape, generator=g))
        model.lm_head.weight.normal_(0.0, head_scale / hidden ** 0.5, generator=g)
        model.lm_head.weight[MASK].zero_()
        model.lm_head.weight[EOS].zero_()
    return model.eval()


def _timed(fn):
    torch.manual_seed(0)
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


VARIANTS = {"fdv2": [dict(use_block_cache=True)]}   # further settings timed by default (Fast-dLLM v2's block cache)


def run_reference(model, family: str, prompt: List[int], gen: int, kw: Optional[dict] = None) -> dict:
    """The reference-shaped loop of a family: its returned sequence, NFE and times (``kw``: the strategy settings,
    default the family's)."""
    kw = dict(SETTINGS[family][3] if kw is None else kw)
    if family == "fdv2":
        fn = lambda: ref_fdv2(model, prompt, gen, MASK, **kw)                                    # noqa: E731
    elif family == "sdar":
        kw.pop("stop_ids")
        fn = lambda: ref_sdar(model, prompt, gen, MASK, stopping_criteria_idx=(), **kw)        # noqa: E731
    else:
        fn = lambda: ref_llada2(model, prompt, gen, MASK, EOS, **kw)                           # noqa: E731
    (tokens, nfe), cpu, wall = _timed(fn)
    return dict(tokens=tokens, nfe=nfe, cpu=cpu, wall=wall)


def run_engine(model, family: str, cache_name: str, prompt: List[int], gen: int, kw: Optional[dict] = None) -> dict:
    """dlm_engine's decode of the same call, its answer cut as the reference returns it."""
    from dlm_engine.strategies.fdv2 import fdv2_gen_length, fdv2_output
    from dlm_engine.strategies.sdar import sdar_gen_length

    sname, _, _, base = SETTINGS[family]
    kw = base if kw is None else kw
    P = len(prompt)
    S, C = strategy_class(sname), cache_class(cache_name)
    if family == "fdv2":
        length = strategy_gen = fdv2_gen_length(P, gen, kw["block_size"])
    elif family == "sdar":
        length = strategy_gen = sdar_gen_length(P, gen, kw["block_length"])
    else:
        length, strategy_gen = -(-(P + gen) // kw["block_length"]) * kw["block_length"] - P, gen
    strategy = S(S.Config(**kw), strategy_gen)
    canvas = Canvas.from_prompts([prompt], length, MASK, EOS, eos_id=EOS if family == "llada2" else None)
    _, cpu, wall = _timed(lambda: decode(model, canvas, strategy, cache=C(C.Config())))
    row = canvas.tokens[0].tolist()
    if family == "fdv2":
        tokens = fdv2_output(row, P, EOS)
    elif family == "sdar":
        tokens = row
    else:
        ans = row[P:P + gen]
        tokens = ans[:ans.index(EOS) + 1] if EOS in ans else ans
    return dict(tokens=tokens, nfe=canvas.nfe, cpu=cpu, wall=wall)


def compare(family: str, prompt: List[int], gen: int, reps: int, model=None, kw: Optional[dict] = None) -> List[dict]:
    """Interleaved rounds of the reference-shaped loop and dlm_engine's decode (after one warm-up of each):
    one row per dlm_engine cache, with medians of process CPU and wall time."""
    model = build_model(family) if model is None else model
    _, cache, store, _ = SETTINGS[family]
    caches = [cache] + ([store] if store else [])
    run_reference(model, family, prompt[:40], 40, kw)              # warm-up (one block of 32 at least)
    for c in caches:
        run_engine(model, family, c, prompt[:40], 40, kw)
    ref, eng = [], {c: [] for c in caches}
    for _ in range(reps):
        ref.append(run_reference(model, family, prompt, gen, kw))
        for c in caches:
            eng[c].append(run_engine(model, family, c, prompt, gen, kw))
    med = lambda rs, k: statistics.median(r[k] for r in rs)                                     # noqa: E731
    rows = []
    for c in caches:
        rows.append(dict(family=family, cache=c, ref_cpu=med(ref, "cpu"), ref_wall=med(ref, "wall"),
                         cpu=med(eng[c], "cpu"), wall=med(eng[c], "wall"), ref_nfe=ref[0]["nfe"],
                         nfe=eng[c][0]["nfe"], same=all(r["tokens"] == ref[0]["tokens"] for r in ref + eng[c])))
    return rows


def settings(family: str) -> List[dict]:
    """The strategy settings timed for a family: its parity setting, then its variants."""
    base = SETTINGS[family][3]
    return [base] + [dict(base, **v) for v in VARIANTS.get(family, [])]


def setting_name(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items() if k not in ("stop_ids", "stop_token"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="fdv2,sdar,llada2")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--store-table", action="store_true", help="also print the cache=none vs block_kv table")
    args = ap.parse_args(argv)
    families = args.family.split(",")
    for family in families:
        if family not in SETTINGS:
            print(f"bench_block_diffusion: unknown family '{family}' (choose {', '.join(SETTINGS)})", file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    load_plugins()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1800, (args.prompt,), generator=g).tolist()
    print(f"prompt {args.prompt}, generation {args.gen}, {args.reps} rounds, {args.threads} thread(s); "
          f"load average {os.getloadavg()[0]:.2f}")
    print("reference-shaped loop (written from the bdparity SPEC) vs dlm_engine, median process CPU / wall seconds")
    print(f"{'family':6} {'setting':72} {'cache':11} {'ref CPU':>8} {'ref wall':>8} {'eng CPU':>8} {'eng wall':>8} "
          f"{'CPU x':>6} {'wall x':>6} {'NFE':>9} same")
    with torch.inference_mode():
        for family, kw in ((f, kw) for f in families for kw in settings(f)):
            for r in compare(family, prompt, args.gen, args.reps, kw=kw):
                print(f"{family:6} {setting_name(kw):72} {r['cache']:11} {r['ref_cpu']:8.3f} {r['ref_wall']:8.3f} "
                      f"{r['cpu']:8.3f} {r['wall']:8.3f} {r['ref_cpu'] / r['cpu']:6.2f} "
                      f"{r['ref_wall'] / r['wall']:6.2f} {r['ref_nfe']:>4}/{r['nfe']:<4} "
                      f"{'yes' if r['same'] and r['ref_nfe'] == r['nfe'] else 'NO'}")
        if args.store_table:
            print(f"\n{'family':6} {'cache':9} {'NFE':>5} {'CPU s':>8} {'wall s':>8} {'tok/fwd':>8} {'CPU x':>6} same")
            for family in (f for f in families if f in FAMILIES):
                model = build(family)
                run(model, family, "block_kv", prompt[:16], 16)                  # warm-up
                rounds = {c: [] for c in ("none", "block_kv")}
                for _ in range(args.reps):
                    for cache in rounds:
                        rounds[cache].append(run(model, family, cache, prompt, args.gen))
                base = statistics.median(r["cpu"] for r in rounds["none"])
                ref = rounds["none"][0]["tokens"]
                for cache, rs in rounds.items():
                    cpu = statistics.median(r["cpu"] for r in rs)
                    wall = statistics.median(r["wall"] for r in rs)
                    r = rs[0]
                    print(f"{family:6} {cache:9} {r['nfe']:5d} {cpu:8.3f} {wall:8.3f} {r['per_step']:8.1f} "
                          f"{base / cpu:6.2f} {r['tokens'] == ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
