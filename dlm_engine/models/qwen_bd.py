"""Block-diffusion Qwen decoders: **Fast-dLLM v2** (``model_type: "Fast_dLLM_Qwen"``, Qwen2.5 converted) and
**SDAR** (``model_type: "sdar"``, Qwen3 converted).

Written from the published checkpoint formats (``config.json`` field names, ``model.layers.*`` / ``lm_head``
parameter names) and the SPEC of ``tests/fixtures/bdparity/README.md``; no remote code. Both are Qwen
decoders with grouped-query attention and full RoPE, run with **block-causal attention**: blocks are aligned
at absolute column 0, a query sees every key of its own block and of earlier blocks. They differ in:

* Fast-dLLM v2 (Qwen2.5): biases on the q/k/v projections; **shifted logits** (the distribution of column
  ``j`` is the head applied to hidden state ``j - 1``), where the first column of the queried block (or
  sub-block) reads its own hidden state (the reference shifts within the block: ``ForwardCall.shift_floor``). Its checkpoints
  name no mask id: ``|<MASK>|`` is 22 ids after ``<|endoftext|>`` (``bos_token_id``) in the Qwen2.5 vocabulary.
* SDAR (Qwen3): no biases, **QK-norm** (an RMSNorm over each head's query and key before RoPE); no shift.

The block size of a call's mask is the strategy's (``CacheDirective.attention_block``), else the model's
(``bd_size`` / ``block_size``): the references build it from the sampler's block length, not from the
config. Which columns a call computes and which stored keys it attends is the cache's business
(``cache/block_kv.py``); this module knows no concrete cache.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.protocol import NULL_HOOKS, CallRequest, ForwardCall
from dlm_engine.models.base import DiffusionLMMixin, register_auto, register_model
from dlm_engine.models.layers import (AttentionSpec, RMSNorm, attention_block, ffn_block, new_call, rope_native,
                                      run_layers, cumsum_positions)

# Qwen2.5's vocabulary: ``|<MASK>|`` (151665) - ``<|endoftext|>`` (151643)
FDV2_MASK_OFFSET = 22


class _QwenBDConfig(PretrainedConfig):
    """Fields both families share (official names; defaults are the 1.5B/1.7B class models')."""

    def __init__(self, vocab_size: int = 151936, hidden_size: int = 2048, intermediate_size: int = 6144,
                 num_hidden_layers: int = 28, num_attention_heads: int = 16, num_key_value_heads: Optional[int] = 8,
                 head_dim: Optional[int] = None, hidden_act: str = "silu", max_position_embeddings: int = 32768,
                 initializer_range: float = 0.02, rms_norm_eps: float = 1e-6, tie_word_embeddings: bool = False,
                 rope_theta: float = 1000000.0, rope_scaling: Optional[dict] = None, mask_token_id: Optional[int] = None,
                 block_size: int = 4, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = float(rope_theta)
        self.block_size = block_size
        # read by the references only in training (SDAR's flex_attention, Fast-dLLM's eager/sdpa): inference here
        # always runs the hooked layers' attention
        kwargs.pop("attn_implementation", None)
        if hidden_act != "silu":
            raise ValueError(f"hidden_act '{hidden_act}' is not supported (Qwen uses silu)")
        if num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE)")
        if rope_scaling and (rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default")):
            raise ValueError(f"rope_scaling {rope_scaling} is not supported (only the default RoPE)")
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        bos = getattr(self, "bos_token_id", None)
        if mask_token_id is None and bos is not None and self.model_type == FastDLLMv2Config.model_type:
            mask_token_id = int(bos) + FDV2_MASK_OFFSET
        if mask_token_id is None:
            raise ValueError("config.json has no mask_token_id (and no bos_token_id to derive it from)")
        if not 0 <= int(mask_token_id) < vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the vocabulary (0..{vocab_size - 1})")
        self.mask_token_id = int(mask_token_id)


class FastDLLMv2Config(_QwenBDConfig):
    """Fast-dLLM v2 (``Fast_dLLM_QwenForCausalLM``): ``bd_size`` is the training block size (32)."""

    model_type = "Fast_dLLM_Qwen"

    def __init__(self, bd_size: int = 32, **kwargs):
        kwargs.pop("block_size", None)
        self.bd_size = bd_size
        super().__init__(block_size=bd_size, **kwargs)


class SDARConfig(_QwenBDConfig):
    """SDAR (``SDARForCausalLM``): ``block_size`` is the training block size (4 for the 4B model)."""

    model_type = "sdar"

    def __init__(self, block_size: int = 4, **kwargs):     # (a config class needs its own __init__ for transformers)
        super().__init__(block_size=block_size, **kwargs)


class QwenBDAttention(nn.Module):
    def __init__(self, cfg: _QwenBDConfig, bias: bool, qk_norm: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """Queries, per-head RMS-normed (SDAR's QK-norm), flat ``[B, T, H * D]``."""
        return _head_norm(self.q_proj(x), self.q_norm, self.head_dim)

    def project_k(self, x: torch.Tensor) -> torch.Tensor:
        return _head_norm(self.k_proj(x), self.k_norm, self.head_dim)


def _head_norm(t: torch.Tensor, norm: RMSNorm, d: int) -> torch.Tensor:
    B, T, _ = t.shape
    return norm(t.view(B, T, -1, d)).view(B, T, -1)


class QwenBDMLP(nn.Module):
    def __init__(self, cfg: _QwenBDConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class QwenBDLayer(nn.Module):
    def __init__(self, cfg: _QwenBDConfig, idx: int, bias: bool, qk_norm: bool):
        super().__init__()
        self.idx = idx
        self.self_attn = QwenBDAttention(cfg, bias, qk_norm)
        self.mlp = QwenBDMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        at = self.self_attn
        q, k = (at.project_q, at.project_k) if qk_norm else (at.q_proj, at.k_proj)
        self.spec = AttentionSpec(q, k, at.v_proj, at.n_heads, at.n_kv_heads, at.head_dim, rope=rope_native)

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        return m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))

    def forward(self, x: torch.Tensor, rope, call: ForwardCall, hooks) -> torch.Tensor:
        x = attention_block(self.idx, x, self.input_layernorm, self.spec, self.self_attn.o_proj, rope, call, hooks)
        return ffn_block(self.idx, x, self.post_attention_layernorm, self.ffn, call, hooks)


class QwenBDBaseModel(nn.Module):
    """The decoder stack under the official names ``model.embed_tokens``, ``model.layers``, ``model.norm``."""

    def __init__(self, cfg: _QwenBDConfig, bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(QwenBDLayer(cfg, i, bias, qk_norm) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _QwenBDModel(DiffusionLMMixin, PreTrainedModel):
    """Shared body; subclasses set the family's flags."""

    # the forward embeds a strategy's soft inputs (CallRequest.soft: a mixture of token embeddings and the mask
    # embedding at chosen columns, layers.embed_call), so strategies that need them (dmax) decode with this family
    offers = caps(Cap.SOFT_INPUTS)

    base_model_prefix = "model"
    _no_split_modules = ["QwenBDLayer"]
    main_input_name = "input_ids"
    bias: bool = False
    qk_norm: bool = False
    shift: int = 0
    # the model is block-causal: strategies that need bidirectional attention over the whole generation refuse it
    block_diffusion = True

    def __init__(self, config):
        super().__init__(config)
        self.model = QwenBDBaseModel(config, self.bias, self.qk_norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.post_init()

    @property
    def init_std(self) -> float:
        return float(self.config.initializer_range)

    @property
    def logits_shift(self) -> int:
        return self.shift

    @property
    def block_size(self) -> int:
        """The block size the model was trained with (``bd_size`` / ``block_size`` of its config)."""
        return int(self.config.block_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, hooks=None,
                logits_range: Optional[Tuple[int, int]] = None, request: Optional[CallRequest] = None,
                shift_logits: bool = True, block_size: Optional[int] = None) -> ForwardCall:
        """Logits for the columns ``logits_range`` (default: all) under the block-causal mask (blocks of
        ``block_size``, else the directive's ``attention_block``, else the model's). ``shift_logits=False``
        returns the raw head output per hidden state (what the reference model itself returns)."""
        hooks = NULL_HOOKS if hooks is None else hooks
        call = new_call(input_ids, attention_mask, position_ids, logits_range, request, cumsum_positions)
        call.logits_shift = self.shift if shift_logits else 0
        call.attention_mode = "block_causal"
        d = call.directive
        if d is not None and d.attention_block:
            # a block-diffusion strategy (fdv2, sdar): blocks aligned at column 0 of the strategy's size, and the
            # shift within the queried block (its first column reads itself), as the references
            call.block_origin, call.block_size = 0, int(d.attention_block)
            call.shift_floor = int((d.query or d.block)[0])
        elif d is not None:
            # any other block-by-block strategy: its blocks (the model's size, counted from the generation start)
            # are the mask's; the prompt is one block before them and column j reads hidden state j - 1
            call.block_origin, call.block_size = None, int(self.config.block_size)
        else:
            call.block_origin, call.block_size = 0, int(block_size or self.config.block_size)
        m, c = self.model, self.config
        return run_layers(call, hooks, m.embed_tokens, m.layers, c.head_dim, c.rope_theta, self._head, c.vocab_size,
                          rope_in_model_dtype=True)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))


@register_model("Fast_dLLM_Qwen")
class FastDLLMv2Model(_QwenBDModel):
    """Fast-dLLM v2 (Qwen2.5 converted): q/k/v biases, shifted logits."""

    config_class = FastDLLMv2Config
    bias = True
    shift = 1


@register_model("sdar")
class SDARModel(_QwenBDModel):
    """SDAR (Qwen3 converted): QK-norm, no biases, no shift."""

    config_class = SDARConfig
    qk_norm = True



def register_auto_classes() -> None:
    register_auto("Fast_dLLM_Qwen", FastDLLMv2Config, FastDLLMv2Model)
    register_auto("sdar", SDARConfig, SDARModel)


__all__ = ["FastDLLMv2Config", "FastDLLMv2Model", "SDARConfig", "SDARModel", "register_auto_classes"]
