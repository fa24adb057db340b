"""Dream architecture (``model_type: "Dream"``): a Qwen2-style decoder used without a causal mask.

Written from the published checkpoint format (``config.json`` field names, ``model.layers.*`` /
``lm_head`` parameter names) and ``specs/dream.md``; no remote code. Differences from LLaDA:
grouped-query attention, biases on the q/k/v projections, RoPE and RMSNorm in the model dtype as
Qwen2 does, and **shifted logits** -- Dream kept its autoregressive parent's next-token head, so the
distribution for canvas column ``j`` is the head applied to the hidden state of column ``j - 1``
(column 0 reuses its own). The model applies the shift itself: ``forward(..., logits_range=(lo, hi))``
returns ordinary per-column logits for ``[lo, hi)``, so strategies and samplers never see the shift.

Caches see the shift in hidden-state coordinates: inside ``hooks.forward(call)`` the call asks for
hidden states ``[lo - 1, hi - 1)`` (``call.extras["logits_shift"] == 1``); a cache that recomputes
only ``call.compute = (s, e)`` lets the model produce columns ``[s + 1, e + 1)`` (plus column 0 when
``s == 0``). Columns it cannot produce exactly are left out of ``call.logits_range``, so the step loop
reports the mismatch instead of decoding from a wrong hidden state.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from dlm_engine.core.protocol import NULL_HOOKS, AttentionIO, FFNIO, ForwardCall, key_padding_mask
from .llada import DiffusionLMMixin, RMSNorm, register_auto, rope_tables


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


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in the tensor's dtype (cos/sin already cast), product with cos first."""
    x1, x2 = t.chunk(2, dim=-1)
    return (t * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, call: ForwardCall, hooks) -> torch.Tensor:
        B, T, _ = x.shape
        s, e = call.compute
        at = self.self_attn
        a = self.input_layernorm(x)
        q = at.q_proj(a).view(B, T, at.n_heads, at.head_dim).transpose(1, 2)
        k = at.k_proj(a).view(B, T, at.n_kv_heads, at.head_dim).transpose(1, 2)
        v = at.v_proj(a).view(B, T, at.n_kv_heads, at.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        io = AttentionIO(q=q, k=k, v=v, query_positions=(s, e),
                         key_columns=torch.arange(s, e, device=x.device), call=call)
        with hooks.attention(self.idx, io) as io:
            kk, vv = io.k, io.v
            if at.n_kv_heads != at.n_heads:
                rep = at.n_heads // at.n_kv_heads
                kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
            mask = None
            if call.key_mask is not None:
                mask = call.key_mask[:, io.key_columns][:, None, None, :]
            out = F.scaled_dot_product_attention(io.q, kk, vv, attn_mask=mask, dropout_p=0.0, is_causal=False)
            if call.key_mask is not None:
                # the reference masks padding as queries too (a fully masked row gives 0): same here
                qs, qe = io.query_positions
                out = out * call.key_mask[:, None, qs:qe, None].to(out.dtype)
            io.out = out
        att = io.out.transpose(1, 2).reshape(B, T, -1)
        x = x + at.o_proj(att)
        fio = FFNIO(x=x, call=call)
        with hooks.ffn(self.idx, fio) as fio:
            hdn = self.post_attention_layernorm(fio.x)
            m = self.mlp
            fio.out = m.down_proj(F.silu(m.gate_proj(hdn)) * m.up_proj(hdn))
        return x + fio.out


class DreamBaseModel(nn.Module):
    """Holds the decoder stack under the official names ``model.embed_tokens``, ``model.layers``, ``model.norm``."""

    def __init__(self, cfg: DreamConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DreamDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def hidden_range(lo: int, hi: int) -> Tuple[int, int]:
    """Hidden states needed for the logits of columns ``[lo, hi)`` (column j <- hidden j-1, 0 <- 0)."""
    if hi <= lo:
        return (max(lo - 1, 0),) * 2
    return max(lo - 1, 0), max(hi - 1, 1)


class DreamModel(DiffusionLMMixin, PreTrainedModel):
    """Dream masked-diffusion LM. ``forward`` returns the :class:`ForwardCall` with shifted ``logits``."""

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
        directive=None,
        extras: Optional[dict] = None,
        shift_logits: bool = True,
    ) -> ForwardCall:
        """Logits for columns ``logits_range`` (default: all). ``shift_logits=False`` returns the raw head
        output per hidden state instead (what the reference model itself returns)."""
        hooks = NULL_HOOKS if hooks is None else hooks
        B, L = input_ids.shape
        key_mask = key_padding_mask(attention_mask)
        if position_ids is None:
            if key_mask is None:
                position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
            else:  # as Dream's _sample builds tok_idx: cumsum - 1, padding at 1 (masked anyway)
                position_ids = (key_mask.long().cumsum(-1) - 1).masked_fill(~key_mask, 1)
        lo, hi = logits_range or (0, L)
        shift = 1 if shift_logits else 0
        call = ForwardCall(
            input_ids=input_ids, position_ids=position_ids, key_mask=key_mask, compute=(0, L),
            logits_range=hidden_range(lo, hi) if shift else (lo, hi), directive=directive,
            extras=dict(extras or {}, logits_shift=shift),
        )
        m = self.model
        with hooks.forward(call) as call:
            s, e = call.compute
            x = m.embed_tokens(input_ids[:, s:e])
            cos, sin = rope_tables(position_ids[:, s:e], self.config.head_dim, self.config.rope_theta)
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            for layer in m.layers:
                x = layer(x, cos, sin, call, hooks)
            hlo, hhi = max(call.logits_range[0], s), min(call.logits_range[1], e)
            if not shift:
                clo, chi = max(lo, hlo), min(hi, hhi)
                call.logits = self.lm_head(m.norm(x[:, clo - s:chi - s]))
            else:
                # column j reads hidden state src(j) = max(j - 1, 0); keep the columns whose source was
                # computed (and granted by the cache); src is monotone, so they are contiguous
                if hhi <= hlo:
                    clo = chi = lo
                else:
                    clo = lo if hlo == 0 else max(lo, hlo + 1)
                    chi = max(min(hi, hhi + 1), clo)
                if chi > clo:
                    a, b = max(clo - 1, 0), max(chi - 2, 0) + 1
                    h = self.lm_head(m.norm(x[:, a - s:b - s]))
                    if clo == 0 and chi >= 2:
                        h = torch.cat([h[:, :1], h], dim=1)
                else:
                    h = x.new_zeros((B, 0, self.config.vocab_size))
                call.logits = h
            call.logits_range = (clo, chi)
        return call


def register_auto_classes() -> None:
    """``model_type: "Dream"`` -> this code."""
    register_auto("Dream", DreamConfig, DreamModel)


__all__ = ["DreamConfig", "DreamModel", "register_auto_classes", "hidden_range"]
