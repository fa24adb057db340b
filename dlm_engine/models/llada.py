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

from dlm_engine.core.protocol import NULL_HOOKS, AttentionIO, FFNIO, ForwardCall, key_padding_mask


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


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    tf = t.float()
    x1, x2 = tf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (tf * cos + rotated * sin).to(t.dtype)


def attention_bias(
    call: ForwardCall, query_cols: Tuple[int, int], key_columns: torch.Tensor, mode: str, block_size: Optional[int]
) -> Optional[torch.Tensor]:
    """Boolean mask [B or 1, 1, Tq, Tk] (True = may attend), or None when nothing is masked."""
    mask = None
    if call.key_mask is not None:
        mask = call.key_mask[:, key_columns][:, None, None, :]
    if mode == "block_causal":
        # blocks count from the generation start unless the caller says otherwise; the prompt is block -1
        origin = int(call.extras.get("block_origin", call.extras.get("gen_start", 0)))
        size = int(call.extras.get("block_size", block_size or 0))
        if size <= 0:
            raise ValueError("block_causal attention needs a block size (config.block_causal_size)")
        qc = torch.arange(query_cols[0], query_cols[1], device=key_columns.device)

        def block_id(c: torch.Tensor) -> torch.Tensor:
            return torch.where(c < origin, torch.full_like(c, -1), torch.div(c - origin, size, rounding_mode="floor"))

        bc = block_id(key_columns)[None, :] <= block_id(qc)[:, None]
        bc = bc[None, None]
        mask = bc if mask is None else (mask & bc)
    return mask


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
        self.attention_mode = cfg.attention_mode
        self.block_causal_size = cfg.block_causal_size

    def forward(self, x, cos, sin, call: ForwardCall, hooks) -> torch.Tensor:
        B, T, _ = x.shape
        s, e = call.compute
        a = self.attn_norm(x)
        q = self.q_proj(a).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(a).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(a).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        io = AttentionIO(q=q, k=k, v=v, query_positions=(s, e),
                         key_columns=torch.arange(s, e, device=x.device), call=call)
        with hooks.attention(self.idx, io) as io:
            kk, vv = io.k, io.v
            if self.n_kv_heads != self.n_heads:
                rep = self.n_heads // self.n_kv_heads
                kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
            bias = attention_bias(call, io.query_positions, io.key_columns, self.attention_mode, self.block_causal_size)
            io.out = F.scaled_dot_product_attention(io.q, kk, vv, attn_mask=bias, dropout_p=0.0, is_causal=False)
        att = io.out.transpose(1, 2).reshape(B, T, -1)
        x = x + self.attn_out(att)
        fio = FFNIO(x=x, call=call)
        with hooks.ffn(self.idx, fio) as fio:
            hdn = self.ff_norm(fio.x)
            fio.out = self.ff_out(F.silu(self.ff_proj(hdn)) * self.up_proj(hdn))
        return x + fio.out


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


class DiffusionLMMixin:
    """What LLaDA and Dream share on top of ``PreTrainedModel``: random initialisation (only random models
    use it: tests, training from scratch) and the mask id the decoding loop needs."""

    init_std: float = 0.02

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.normal_(module.bias, std=self.init_std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    @property
    def mask_token_id(self) -> int:
        return int(self.config.mask_token_id)


def register_auto(model_type: str, config_cls, model_cls) -> None:
    """Make ``AutoConfig``/``AutoModel``/``AutoModelForMaskedLM`` resolve ``model_type`` to our own code
    (never remote code); registering twice is harmless."""
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

    try:
        AutoConfig.register(model_type, config_cls)
    except ValueError:
        pass
    for auto in (AutoModel, AutoModelForMaskedLM):
        try:
            auto.register(config_cls, model_cls)
        except ValueError:
            pass


class LLaDAModelLM(DiffusionLMMixin, PreTrainedModel):
    """LLaDA masked-diffusion LM. ``forward`` returns the :class:`ForwardCall` with ``logits`` set."""

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
        directive=None,
        extras: Optional[dict] = None,
    ) -> ForwardCall:
        hooks = NULL_HOOKS if hooks is None else hooks
        B, L = input_ids.shape
        key_mask = key_padding_mask(attention_mask)
        if position_ids is None:
            if key_mask is None:
                position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
            else:
                position_ids = (key_mask.long().cumsum(-1) - 1).clamp_min(0)
        call = ForwardCall(
            input_ids=input_ids, position_ids=position_ids, key_mask=key_mask, compute=(0, L),
            logits_range=logits_range or (0, L), directive=directive,
            extras=dict(extras or {}, attention_mode=self.config.attention_mode),
        )
        t = self.model.transformer
        with hooks.forward(call) as call:
            s, e = call.compute
            x = t.wte(input_ids[:, s:e])
            cos, sin = rope_tables(position_ids[:, s:e], self.config.d_model // self.config.n_heads, self.config.rope_theta)
            for blk in t.blocks:
                x = blk(x, cos, sin, call, hooks)
            lo, hi = max(call.logits_range[0], s), min(call.logits_range[1], e)
            call.logits_range = (lo, hi)
            h = t.ln_f(x[:, lo - s:hi - s])
            if self.config.weight_tying:
                call.logits = F.linear(h, t.wte.weight)
            else:
                call.logits = t.ff_out(h)
        return call


def register_auto_classes() -> None:
    """``model_type: llada`` -> this code."""
    register_auto("llada", LLaDAConfig, LLaDAModelLM)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["LLaDAConfig", "LLaDAModelLM", "register_auto_classes", "count_parameters"]
