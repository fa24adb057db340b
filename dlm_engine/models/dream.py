"""Dream architecture (``model_type: "Dream"``): a Qwen2-style decoder used without a causal mask.

Written from the published checkpoint format (``config.json`` field names, ``model.layers.*`` /
``lm_head`` parameter names) and ``docs/specs/dream.md``; no remote code. Differences from LLaDA:
grouped-query attention, biases on the q/k/v projections, RoPE and RMSNorm in the model dtype as
Qwen2 does, and **shifted logits** -- Dream kept its autoregressive parent's next-token head, so the
distribution for canvas column ``j`` is the head applied to the hidden state of column ``j - 1``
(column 0 reuses its own). The model applies the shift itself: ``forward(..., logits_range=(lo, hi))``
returns ordinary per-column logits for ``[lo, hi)``, so strategies and samplers never see the shift.

Caches see the shift through :attr:`ForwardCall.logits_shift`: window column ``j`` is valid only when hidden
state ``j - 1`` was computed (``ForwardCall.valid``), so a cache that recomputes the block ``[s, e)`` must
also recompute column ``s - 1`` to give valid logits for ``s``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.protocol import NULL_HOOKS, CallRequest, ForwardCall
from dlm_engine.models.layers import (AttentionSpec, RMSNorm, attention_block, ffn_block, new_call, rope_native,
                                      run_layers)
from dlm_engine.models.base import DiffusionLMMixin, register_auto, register_model


class DreamConfig(PretrainedConfig):
    """Configuration of Dream checkpoints (official field names; defaults are DreamConfig's own)."""

    model_type = "Dream"

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 22016,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: Optional[int] = 32,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = False,
        tie_word_embeddings: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: Optional[dict] = None,
        use_sliding_window: bool = False,
        sliding_window: Optional[int] = 4096,
        max_window_layers: int = 28,
        attention_dropout: float = 0.0,
        mask_token_id: int = 151666,
        pad_token_id: Optional[int] = 151643,
        eot_token_id: Optional[int] = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta  # rope_scaling: only null / default is accepted (checked below)
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        self.max_window_layers = max_window_layers
        self.attention_dropout = attention_dropout
        self.mask_token_id = mask_token_id
        self.eot_token_id = eot_token_id
        if hidden_act != "silu":
            raise ValueError(f"hidden_act '{hidden_act}' is not supported (Dream uses silu)")
        if hidden_size % num_attention_heads != 0:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}")
        if num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if rope_scaling and (rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default")):
            raise ValueError(f"rope_scaling {rope_scaling} is not supported (only the default RoPE)")
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class DreamAttention(nn.Module):
    def __init__(self, cfg: DreamConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)


class DreamMLP(nn.Module):
    def __init__(self, cfg: DreamConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class DreamDecoderLayer(nn.Module):
    def __init__(self, cfg: DreamConfig, idx: int):
        super().__init__()
        self.idx = idx
        self.self_attn = DreamAttention(cfg)
        self.mlp = DreamMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        at = self.self_attn
        self.spec = AttentionSpec(at.q_proj, at.k_proj, at.v_proj, at.n_heads, at.n_kv_heads, at.head_dim,
                                  rope=rope_native, zero_padding_queries=True)

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        return m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))

    def forward(self, x: torch.Tensor, rope, call: ForwardCall, hooks) -> torch.Tensor:
        x = attention_block(self.idx, x, self.input_layernorm, self.spec, self.self_attn.o_proj, rope, call, hooks)
        return ffn_block(self.idx, x, self.post_attention_layernorm, self.ffn, call, hooks)


class DreamBaseModel(nn.Module):
    """Holds the decoder stack under the official names ``model.embed_tokens``, ``model.layers``, ``model.norm``."""

    def __init__(self, cfg: DreamConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DreamDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@register_model("Dream")
class DreamModel(DiffusionLMMixin, PreTrainedModel):
    """Dream masked-diffusion LM. ``forward`` returns the :class:`ForwardCall` with shifted ``logits``."""

    # the forward embeds a strategy's soft inputs (CallRequest.soft: a mixture of token embeddings and the mask
    # embedding at chosen columns, layers.embed_call), so strategies that need them (dmax) decode with this family
    offers = caps(Cap.SOFT_INPUTS)

    config_class = DreamConfig
    base_model_prefix = "model"
    _no_split_modules = ["DreamDecoderLayer"]
    main_input_name = "input_ids"

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def init_std(self) -> float:
        return float(self.config.initializer_range)

    @property
    def logits_shift(self) -> int:
        """Dream predicts column j from hidden state j - 1 (column 0 from itself)."""
        return 1

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        hooks=None,
        logits_range: Optional[Tuple[int, int]] = None,
        request: Optional[CallRequest] = None,
        shift_logits: bool = True,
    ) -> ForwardCall:
        """Logits for columns ``logits_range`` (default: all), shifted so that column ``j`` holds the
        distribution of token ``j``. ``shift_logits=False`` returns the raw head output per hidden state
        instead (what the reference model itself returns)."""
        hooks = NULL_HOOKS if hooks is None else hooks
        call = new_call(input_ids, attention_mask, position_ids, logits_range, request, _positions)
        call.logits_shift = 1 if shift_logits else 0
        m, c = self.model, self.config
        return run_layers(call, hooks, m.embed_tokens, m.layers, c.head_dim, c.rope_theta, self._head, c.vocab_size,
                          rope_in_model_dtype=True)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))


def _positions(key_mask, B: int, L: int, device) -> torch.Tensor:
    """As Dream's ``_sample`` builds ``tok_idx``: ``cumsum(mask) - 1``, padding at 1 (masked anyway)."""
    if key_mask is None:
        return torch.arange(L, device=device).expand(B, L)
    return (key_mask.long().cumsum(-1) - 1).masked_fill(~key_mask, 1)


def register_auto_classes() -> None:
    """``model_type: "Dream"`` -> this code."""
    register_auto("Dream", DreamConfig, DreamModel)


__all__ = ["DreamConfig", "DreamModel", "register_auto_classes"]
