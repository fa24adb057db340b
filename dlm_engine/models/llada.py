"""LLaDA architecture (``model_type: llada``), written from the published checkpoint format.

Loads official directories (config.json + safetensors with the official parameter names,
``model.transformer.*``) without remote code. Bidirectional attention by default; an optional
block-causal mode serves block-diffusion variants. Caches plug in through
:mod:`dlm_engine.core.protocol`; this module knows no concrete cache.
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
from dlm_engine.models.layers import (AttentionSpec, RMSNorm, attention_block, ffn_block, new_call, rope_float32,
                                      run_layers, cumsum_positions)


class LLaDAConfig(PretrainedConfig):
    model_type = "llada"

    def __init__(
        self,
        d_model: int = 4096,
        n_heads: int = 32,
        n_kv_heads: Optional[int] = None,
        n_layers: int = 32,
        mlp_hidden_size: int = 12288,
        vocab_size: int = 126464,
        embedding_size: Optional[int] = 126464,
        max_sequence_length: int = 4096,
        rope_theta: float = 500000.0,
        rms_norm_eps: float = 1e-5,
        mask_token_id: int = 126336,
        eos_token_id: int = 126081,
        pad_token_id: int = 126081,
        eot_token_id: Optional[int] = None,
        weight_tying: bool = False,
        block_type: str = "llama",
        attention_mode: str = "bidirectional",
        block_causal_size: Optional[int] = None,
        **kwargs,
    ):
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads if n_kv_heads is not None else n_heads
        self.n_layers = n_layers
        self.mlp_hidden_size = mlp_hidden_size
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size if embedding_size is not None else vocab_size
        self.max_sequence_length = max_sequence_length
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.mask_token_id = mask_token_id
        self.eot_token_id = eot_token_id
        self.weight_tying = weight_tying
        self.block_type = block_type
        self.attention_mode = attention_mode
        self.block_causal_size = block_causal_size
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=weight_tying,
            **kwargs,
        )

    # names transformers' generic code looks for
    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads


class LLaDABlock(nn.Module):
    def __init__(self, cfg: LLaDAConfig, idx: int):
        super().__init__()
        self.idx = idx
        d, h = cfg.d_model, cfg.n_heads
        self.n_heads = h
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = d // h
        kv = self.n_kv_heads * self.head_dim
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(cfg.mlp_hidden_size, d, bias=False)
        if cfg.attention_mode not in ("bidirectional", "block_causal"):
            raise ValueError(f"attention_mode '{cfg.attention_mode}' (choose bidirectional or block_causal)")
        self.spec = AttentionSpec(self.q_proj, self.k_proj, self.v_proj, h, self.n_kv_heads, self.head_dim,
                                  rope=rope_float32)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))

    def forward(self, x, rope, call: ForwardCall, hooks) -> torch.Tensor:
        x = attention_block(self.idx, x, self.attn_norm, self.spec, self.attn_out, rope, call, hooks)
        return ffn_block(self.idx, x, self.ff_norm, self.mlp, call, hooks)


class LLaDATransformer(nn.Module):
    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.embedding_size, cfg.d_model)
        self.blocks = nn.ModuleList(LLaDABlock(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        if not cfg.weight_tying:
            self.ff_out = nn.Linear(cfg.d_model, cfg.embedding_size, bias=False)


class LLaDAInner(nn.Module):
    """Holds ``transformer`` so parameter names match the official ``model.transformer.*``."""

    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        self.transformer = LLaDATransformer(cfg)


@register_model("llada")
class LLaDAModelLM(DiffusionLMMixin, PreTrainedModel):
    """LLaDA masked-diffusion LM. ``forward`` returns the :class:`ForwardCall` with ``logits`` set."""

    # the forward embeds a strategy's soft inputs (CallRequest.soft: a mixture of token embeddings and the mask
    # embedding at chosen columns, layers.embed_call), so strategies that need them (dmax) decode with this family
    offers = caps(Cap.SOFT_INPUTS)

    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDABlock"]
    main_input_name = "input_ids"

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        self.model = LLaDAInner(config)
        self.post_init()

    init_std = 0.02

    @property
    def logits_shift(self) -> int:
        """LLaDA predicts position i from hidden state i (Dream shifts by one)."""
        return 0

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        hooks=None,
        logits_range: Optional[Tuple[int, int]] = None,
        request: Optional[CallRequest] = None,
    ) -> ForwardCall:
        """Logits for the columns ``logits_range`` (default: all). ``request`` carries the step's cache
        directive, active rows and auxiliary columns (see :mod:`dlm_engine.core.protocol`)."""
        hooks = NULL_HOOKS if hooks is None else hooks
        call = new_call(input_ids, attention_mask, position_ids, logits_range, request, cumsum_positions)
        call.attention_mode = self.config.attention_mode
        call.block_size = self.config.block_causal_size
        t, c = self.model.transformer, self.config
        return run_layers(call, hooks, t.wte, t.blocks, c.d_model // c.n_heads, c.rope_theta, self._head,
                          c.embedding_size, rope_in_model_dtype=False)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        h = t.ln_f(h)
        return F.linear(h, t.wte.weight) if self.config.weight_tying else t.ff_out(h)



def register_auto_classes() -> None:
    """``model_type: llada`` -> this code."""
    register_auto("llada", LLaDAConfig, LLaDAModelLM)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["LLaDAConfig", "LLaDAModelLM", "register_auto_classes", "count_parameters"]
