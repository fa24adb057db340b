"""LLaDA2.x MoE architecture (``model_type: llada2_moe``, ``LLaDA2MoeModelLM``): LLaDA2.0-mini / -flash and
LLaDA2.1-mini, written from the published checkpoint format and the SPEC of ``tests/fixtures/bdparity/README.md``
(section ``llada2``); no remote code.

What differs from LLaDA-8B:

* **attention**: one fused ``query_key_value`` projection (``H`` query heads, then ``KV`` key heads, then ``KV``
  value heads, ``head_dim`` rows each), a per-head RMSNorm of queries and keys (one weight shared by all heads,
  *before* RoPE), **partial RoPE** on the first ``head_dim * partial_rotary_factor`` channels of each head, GQA;
* **block-causal attention** with blocks aligned to absolute column 0 (position ``i`` sees ``j`` iff
  ``j // bl <= i // bl``); the block size is the decoding's (``CacheDirective.attention_block``, else
  ``config.block_size``, 32 = the reference ``generate``'s default);
* **MoE feed-forward** after the first ``first_k_dense_replace`` dense layers: a sigmoid router computed in
  float32, whose ``expert_bias`` decides the *selection* only (group-limited top-k: ``n_group`` groups scored by
  the sum of their two best biased scores, the best ``topk_group`` groups kept), weights from the un-biased
  scores, renormalised (``k > 1``) and scaled by ``routed_scaling_factor``; plus ``num_shared_experts`` shared
  experts as one wider SwiGLU. The experts run as **batched dispatch**: the (token, slot) pairs are sorted by
  expert and every active expert runs one matmul over its tokens (:func:`dispatch`), no loop over tokens.

Logits are returned in float32 (the reference's ``.float()``), whatever the model dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.protocol import NULL_HOOKS, CallRequest, Columns, ForwardCall
from dlm_engine.models.base import DiffusionLMMixin, register_auto, register_model
from dlm_engine.models.layers import (AttentionSpec, RMSNorm, attention_block, ffn_block, new_call, rotate_half,
                                      run_layers, cumsum_positions)

# ``<|mask|>`` sits three ids after ``<|endoftext|>`` (the pad / EOS) in the LLaDA2 vocabulary (156892 -> 156895);
# config.json names neither the mask nor the EOS, so they default from ``pad_token_id``
MASK_OFFSET_FROM_PAD = 3


class LLaDA2MoeConfig(PretrainedConfig):
    """Configuration of LLaDA2.x MoE checkpoints (official field names; defaults are LLaDA2.0-mini's)."""

    model_type = "llada2_moe"

    def __init__(
        self,
        vocab_size: int = 157184,
        hidden_size: int = 2048,
        intermediate_size: int = 5120,
        num_hidden_layers: int = 20,
        num_attention_heads: int = 16,
        num_key_value_heads: Optional[int] = 4,
        head_dim: Optional[int] = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 600000.0,
        rope_scaling: Optional[dict] = None,
        partial_rotary_factor: float = 0.5,
        use_qkv_bias: bool = False,
        use_bias: bool = False,
        use_qk_norm: bool = True,
        num_experts: Optional[int] = 256,
        num_experts_per_tok: int = 8,
        n_group: int = 8,
        topk_group: int = 4,
        routed_scaling_factor: float = 2.5,
        moe_intermediate_size: int = 512,
        num_shared_experts: Optional[int] = 1,
        first_k_dense_replace: int = 1,
        tie_word_embeddings: bool = False,
        pad_token_id: Optional[int] = 156892,
        eos_token_id: Optional[int] = None,
        mask_token_id: Optional[int] = None,
        block_size: int = 32,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim if head_dim else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta      # rope_scaling: only null / default is accepted (checked below)
        self.partial_rotary_factor = partial_rotary_factor
        self.use_qkv_bias = use_qkv_bias
        self.use_bias = use_bias
        self.use_qk_norm = use_qk_norm
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.moe_intermediate_size = moe_intermediate_size
        self.num_shared_experts = num_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        if mask_token_id is None and pad_token_id is not None:
            mask_token_id = pad_token_id + MASK_OFFSET_FROM_PAD
        if eos_token_id is None:
            eos_token_id = pad_token_id
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        if mask_token_id is None or not 0 <= mask_token_id < vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the vocabulary (0..{vocab_size - 1}): "
                             "config.json names no mask id, it defaults to pad_token_id + 3; set mask_token_id")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act '{hidden_act}' is not supported (LLaDA2 uses silu)")
        if rope_scaling and (rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default")):
            raise ValueError(f"rope_scaling {rope_scaling} is not supported (only the default RoPE)")
        if num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        rot = self.rope_dim
        if rot % 2 or not 0 < rot <= self.head_dim:
            raise ValueError(f"partial_rotary_factor {partial_rotary_factor} gives {rot} rotary channels of head_dim "
                             f"{self.head_dim} (need an even number in 2..head_dim)")
        if num_experts:
            if n_group < 1 or num_experts % n_group:
                raise ValueError(f"num_experts {num_experts} is not divisible by n_group {n_group}")
            if not 1 <= topk_group <= n_group:
                raise ValueError(f"topk_group {topk_group} is outside 1..n_group={n_group}")
            if not 1 <= num_experts_per_tok <= topk_group * (num_experts // n_group):
                raise ValueError(f"num_experts_per_tok {num_experts_per_tok} is outside "
                                 f"1..{topk_group * (num_experts // n_group)} "
                                 "(the experts of topk_group groups)")
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` under the official names (dense MLP, each expert, the shared experts)."""

    def __init__(self, d: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """``mlp.gate``: the sigmoid router (``weight`` [E, d], the ``expert_bias`` buffer [E])."""

    def __init__(self, cfg: LLaDA2MoeConfig):
        super().__init__()
        E = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(E))
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.scale = float(cfg.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(idx [N, k], weights [N, k] float32)`` for ``x`` [N, d]: experts in descending biased score."""
        N = x.shape[0]
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))      # float32, whatever the model dtype
        biased = scores + self.expert_bias                                     # selection only
        groups = biased.view(N, self.n_group, -1)
        gscore = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(-1)     # [N, n_group]
        keep = torch.zeros_like(gscore, dtype=torch.bool)
        keep.scatter_(1, gscore.topk(self.topk_group, dim=-1, sorted=False)[1], True)
        masked = biased.masked_fill(~keep[:, :, None].expand_as(groups).reshape(N, -1), float("-inf"))
        idx = masked.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, idx)
        if self.top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scale


def dispatch(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """Routed-expert output ``[N, d]`` for tokens ``x`` [N, d] and their experts ``idx`` / ``weights`` [N, k].

    Batched dispatch: the N*k (token, slot) pairs are sorted by expert (ties in token order), each active expert
    runs once on its contiguous run of tokens (one matmul per projection), the outputs go back to their pairs,
    are weighted in float32 and summed over the k slots in the router's order, then cast to the model dtype."""
    N, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()        # the one host read of the layer
    tokens = x.index_select(0, order // k)
    outs, at = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(experts[e](tokens[at:at + n]))
            at += n
    out = torch.empty((N * k, x.shape[1]), dtype=x.dtype, device=x.device)
    out[order] = torch.cat(outs) if outs else tokens
    return (out.view(N, k, -1).float() * weights[..., None]).sum(dim=1).to(x.dtype)


def dispatch_per_token(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                       experts: nn.ModuleList) -> torch.Tensor:
    """The same output computed token by token and slot by slot (the naive loop :func:`dispatch` replaces; kept
    for ``experiments/bench_moe.py`` and the tests)."""
    rows = []
    for t in range(x.shape[0]):
        acc = [experts[int(e)](x[t:t + 1]).float() * w for e, w in zip(idx[t].tolist(), weights[t])]
        rows.append(torch.stack(acc, 0).sum(0))
    return torch.cat(rows).to(x.dtype)


class MoE(nn.Module):
    """``mlp`` of an MoE layer: ``gate`` (router), ``experts.e``, ``shared_experts``."""

    def __init__(self, cfg: LLaDA2MoeConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.num_shared_experts or 0
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * shared) if shared else None
        self.per_token = False                  # True: the slow reference loop (bench_moe compares both)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.shape[0] == 0:
            return x.clone()
        idx, w = self.gate(flat)
        y = (dispatch_per_token if self.per_token else dispatch)(flat, idx, w, self.experts)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(shape)


class FusedQKV:
    """The fused ``query_key_value`` projection split into the q / k / v callables :class:`AttentionSpec` takes.

    ``q(x)`` runs the fused matmul once and keeps the key/value parts for the ``k(x)`` / ``v(x)`` that follow on
    the same input (``attention_block`` calls them in that order); a ``k`` or ``v`` on another input (a cache's
    ``project_v``) runs its own slice. Queries and keys leave normalised per head (QK norm before RoPE)."""

    def __init__(self, attn: "LLaDA2Attention"):
        self.a = attn
        self.last: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def _split(self, x: torch.Tensor):
        a = self.a
        qkv = a.query_key_value(x)
        nq, nk = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        return qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]

    def _norm(self, t: torch.Tensor, norm: Optional[nn.Module]) -> torch.Tensor:
        if norm is None:
            return t
        shape = t.shape
        return norm(t.reshape(*shape[:-1], -1, self.a.head_dim)).reshape(shape)

    def q(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(x)
        self.last = (x, k, v)
        return self._norm(q, self.a.query_layernorm)

    def _part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self.last is not None and self.last[0] is x:
            return self.last[i]
        return self._split(x)[i]

    def k(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(self._part(x, 1), self.a.key_layernorm)

    def v(self, x: torch.Tensor) -> torch.Tensor:
        out = self._part(x, 2)
        if self.last is not None and self.last[0] is x:
            self.last = None                     # (the layer's last use: do not keep activations alive)
        return out


def rope_partial(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` channels of each head (model dtype, as the reference); the rest pass."""
    d = cos.shape[-1]
    if d == t.shape[-1]:
        return t * cos + rotate_half(t) * sin
    r = t[..., :d]
    return torch.cat((r * cos + rotate_half(r) * sin, t[..., d:]), dim=-1)


class LLaDA2Attention(nn.Module):
    """``attention``: ``query_key_value``, ``query_layernorm``, ``key_layernorm``, ``dense``."""

    def __init__(self, cfg: LLaDA2MoeConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.query_key_value = nn.Linear(d, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=cfg.use_qkv_bias)
        self.query_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.key_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.dense = nn.Linear(self.n_heads * self.head_dim, d, bias=cfg.use_bias)


class LLaDA2DecoderLayer(nn.Module):
    def __init__(self, cfg: LLaDA2MoeConfig, idx: int):
        super().__init__()
        self.idx = idx
        self.attention = LLaDA2Attention(cfg)
        moe = cfg.num_experts and idx >= cfg.first_k_dense_replace
        self.mlp = MoE(cfg) if moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        a = self.attention
        qkv = FusedQKV(a)
        self.spec = AttentionSpec(qkv.q, qkv.k, qkv.v, a.n_heads, a.n_kv_heads, a.head_dim, rope=rope_partial)

    def forward(self, x: torch.Tensor, rope, call: ForwardCall, hooks) -> torch.Tensor:
        x = attention_block(self.idx, x, self.input_layernorm, self.spec, self.attention.dense, rope, call, hooks)
        return ffn_block(self.idx, x, self.post_attention_layernorm, self.mlp, call, hooks)


class LLaDA2Inner(nn.Module):
    """``model.word_embeddings``, ``model.layers``, ``model.norm`` (the official names)."""

    def __init__(self, cfg: LLaDA2MoeConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LLaDA2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@register_model("llada2_moe")
class LLaDA2MoeModelLM(DiffusionLMMixin, PreTrainedModel):
    """LLaDA2.x MoE block-diffusion LM. ``forward`` returns the :class:`ForwardCall` with float32 ``logits``."""

    # the forward embeds a strategy's soft inputs (CallRequest.soft: a mixture of token embeddings and the mask
    # embedding at chosen columns, layers.embed_call), so strategies that need them (dmax) decode with this family
    offers = caps(Cap.SOFT_INPUTS)

    config_class = LLaDA2MoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDA2DecoderLayer"]
    main_input_name = "input_ids"

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.model = LLaDA2Inner(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Router):
            nn.init.normal_(module.weight, std=self.init_std)

    # the model is block-causal: strategies that need bidirectional attention over the whole generation refuse it,
    # and a block-by-block one decodes with the model's block size (core.capabilities.model_incompatibility)
    block_diffusion = True

    @property
    def logits_shift(self) -> int:
        return 0

    @property
    def block_size(self) -> int:
        """The block-causal block size used when the decoding names none (``config.block_size``)."""
        return int(self.config.block_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        hooks=None,
        logits_range: Optional[Tuple[int, int]] = None,
        request: Optional[CallRequest] = None,
        block_size: Optional[int] = None,
    ) -> ForwardCall:
        """Logits for the columns ``logits_range`` (default: all). The block-causal block size is ``block_size``,
        else the step's ``CacheDirective.attention_block``, else ``config.block_size``; blocks start at column 0."""
        hooks = NULL_HOOKS if hooks is None else hooks
        call = new_call(input_ids, attention_mask, position_ids, logits_range, request, cumsum_positions)
        d = call.request.directive
        call.attention_mode = "block_causal"
        if block_size is None and d is not None and not d.attention_block:
            # any other block-by-block strategy (threshold, factor, the d2c family, ...): its blocks, of the model's
            # size and counted from the generation start, are the mask's; the prompt is one block before them (as
            # on the Fast-dLLM v2 / SDAR models)
            size, origin = int(self.config.block_size), int(call.gen_start)
            call.block_origin = None
        else:
            size = int(block_size or (d.attention_block if d is not None and d.attention_block else None)
                       or self.config.block_size)
            origin = call.block_origin = 0
        call.block_size = size
        # columns in blocks after the window's last one cannot influence it: leave them out (the reference forwards
        # x[:, :window_end] too); a cache may still choose its own span
        last = int(call.logits_range[1])
        end = min(call.length, last if last <= origin else origin + -(-(last - origin) // size) * size)
        if call.request.aux is None and 0 < end < call.length:
            call.columns = Columns.span(0, end)
        m, c = self.model, self.config
        return run_layers(call, hooks, m.word_embeddings, m.layers, c.rope_dim, c.rope_theta, self._head,
                          c.vocab_size, rope_in_model_dtype=True)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h)).float()



def register_auto_classes() -> None:
    """``model_type: llada2_moe`` -> this code."""
    register_auto("llada2_moe", LLaDA2MoeConfig, LLaDA2MoeModelLM)


__all__ = ["LLaDA2MoeConfig", "LLaDA2MoeModelLM", "Router", "MoE", "dispatch", "dispatch_per_token",
           "register_auto_classes"]
