"""The interface between model code and KV caches.

Model code calls three context managers and knows nothing else about caching:

* ``hooks.forward(call)`` around the whole forward pass. The cache may narrow
  ``call.compute`` (which canvas columns are fed through the layers) and narrows
  ``call.logits_range`` to what it can produce; the model fills ``call.logits``.
* ``hooks.attention(layer, io)`` around each attention layer. The cache may replace
  ``io.k``/``io.v`` (e.g. prepend stored keys) and their ``io.key_positions``;
  it can read ``io.out`` on exit.
* ``hooks.ffn(layer, io)`` around each feed-forward layer.

``NullHooks`` is the no-cache behaviour; concrete caches live in ``cache/``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Tuple

import torch


@dataclass
class ForwardCall:
    """One model call over a canvas. Column indices are canvas coordinates."""

    input_ids: torch.Tensor                      # [B, L] whole canvas
    position_ids: torch.Tensor                   # [B, L]
    key_mask: Optional[torch.Tensor]             # [B, L] bool, False = padding; None = no padding
    compute: Tuple[int, int]                     # columns fed through the layers
    logits_range: Tuple[int, int]                # columns whose logits are wanted
    directive: Any = None                        # the step's cache directive (opaque to the model)
    logits: Optional[torch.Tensor] = None        # [B, hi-lo, V] for logits_range, set by the model
    extras: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class AttentionIO:
    """Queries/keys/values of one attention layer (after RoPE), heads-first layout."""

    q: torch.Tensor                              # [B, H, Tq, D]
    k: torch.Tensor                              # [B, Hkv, Tk, D]
    v: torch.Tensor                              # [B, Hkv, Tk, D]
    query_positions: Tuple[int, int]             # canvas columns of the queries
    key_columns: torch.Tensor                    # [Tk] canvas column of every key
    call: ForwardCall
    out: Optional[torch.Tensor] = None           # [B, H, Tq, D], set by the model


@dataclass
class FFNIO:
    x: torch.Tensor                              # [B, T, d] residual stream entering the FFN block
    call: ForwardCall
    out: Optional[torch.Tensor] = None           # [B, T, d] FFN output (before the residual add)


def key_padding_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Boolean key mask (False = padding), or None when nothing is padded so attention stays unmasked."""
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    return None if bool(mask.all()) else mask


class NullHooks:
    """No caching: every call computes every column."""

    @contextmanager
    def forward(self, call: ForwardCall) -> Iterator[ForwardCall]:
        yield call

    @contextmanager
    def attention(self, layer: int, io: AttentionIO) -> Iterator[AttentionIO]:
        yield io

    @contextmanager
    def ffn(self, layer: int, io: FFNIO) -> Iterator[FFNIO]:
        yield io


NULL_HOOKS = NullHooks()
