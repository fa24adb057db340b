"""The typed protocol between the step loop, model code and KV caches.

The loop describes a model call with a :class:`CallRequest`; the model turns it into a
:class:`ForwardCall` and runs it inside the hooks' context managers. Model code knows nothing else about
caching, and caches know nothing about the model family beyond the fields named here.

* ``hooks.forward(call)`` wraps the whole forward pass. A cache may narrow :attr:`ForwardCall.columns`
  (which canvas columns get a residual stream: a span, or an arbitrary index set per row). The model
  fills :attr:`ForwardCall.logits` for the requested window and :attr:`ForwardCall.valid` says which of
  those columns were actually computed.
* ``hooks.attention(layer, io)`` wraps each attention layer *before* the Q/K/V projections. On entry a
  cache may choose :attr:`AttentionIO.query_cols` (a subset of the call's columns that goes through the
  projections; the others keep the cache's stored output) and ask for the head-averaged attention
  weights (:attr:`AttentionIO.need_weights`). Inside, the model projects the selected rows and calls
  ``hooks.keys_values(layer, io, k, v)``, which returns the keys/values to attend to -- fresh ones merged
  into the cache's store, or the fresh ones unchanged. On exit :attr:`AttentionIO.out` must cover every
  column of the call (a cache that narrowed the queries widens it from its store; it may apply
  :attr:`AttentionIO.out_proj` itself and set :attr:`AttentionIO.projected`, to keep projected outputs).
* ``hooks.ffn(layer, io)`` wraps each feed-forward block in the same way (:attr:`FFNIO.cols`).

:class:`NullHooks` is the no-cache behaviour; concrete caches live in ``cache/``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch


@dataclass
class CacheDirective:
    """Block structure a strategy hands to the cache each step.

    ``block``: the canvas columns being decoded; ``block_start``: first step of that block;
    ``store``: completed blocks whose keys/values may be stored for good (block buffer).
    ``stored``: filled by the cache during the forward with the ``store`` ranges it actually stored, so
    the strategy can report them as ``stored`` block events (stays empty with caches that store nothing).

    A strategy whose rows decode different blocks at once (``block_buffer``: a buffer per row) also gives, per
    canvas row, its own block (``row_blocks``: ``[B, 2]`` host array of canvas columns ``[lo, hi)``, ``lo == hi``
    for none), whether this step starts it (``row_block_start``, ``[B]`` bool) and the step within it
    (``row_step_in_block``, ``[B]`` int); ``block`` is then the union the call computes. The span caches
    (``prefix``, ``dual``) recompute and store for each row only what it would alone, so a row's trajectory does
    not depend on its neighbours; other caches use ``block``/``block_start`` for every row.
    """

    block: Tuple[int, int]
    block_start: bool
    step_in_block: int = 0
    store: List[Tuple[int, int]] = field(default_factory=list)
    stored: List[Tuple[int, int]] = field(default_factory=list)
    row_blocks: Optional[Any] = None
    row_block_start: Optional[Any] = None
    row_step_in_block: Optional[Any] = None
    # block-diffusion models (Fast-dLLM v2, SDAR, LLaDA2): the block size of this call's block-causal mask (None =
    # the model's own), the columns the call queries when only part of the block is (a sub-block; None = ``block``)
    # and the first column its keys may come from (0 = all; a reference that never attends the prompt sets more)
    attention_block: Optional[int] = None
    query: Optional[Tuple[int, int]] = None
    key_start: int = 0


@dataclass
class AuxColumns:
    """Extra query columns appended after the canvas for one call (e.g. WINO's shadow block).

    ``tokens``/``positions`` are ``[B, W]``; ``attend`` is the boolean attention mask ``[B, L + W, L + W]``
    (True = may attend) of the whole call, canvas and aux columns together. Their logits come back in
    :attr:`ForwardCall.aux_logits` (model order, unshifted for shifted-logit models: column ``i`` is the head
    applied to aux hidden state ``i - shift``, the canvas' last column for ``i = 0`` -- as the reference -- unless
    ``shift_within``)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    attend: torch.Tensor
    shift_within: bool = False        # shifted models: slot 0 reads its own hidden state, not the canvas' last

    def take(self, rows: torch.Tensor) -> "AuxColumns":
        """The aux columns of some rows of the batch."""
        return AuxColumns(self.tokens[rows], self.positions[rows], self.attend[rows], self.shift_within)


SOFT_MIXES = ("dinfer", "diffulex")


@dataclass
class SoftInputs:
    """Input embeddings for chosen canvas columns instead of their tokens' (DMax's soft parallel decoding, spec
    ``edit_decoding.md`` 3.4). At the columns ``where`` the model embeds the mixture
    ``sum_k probs[k] * E[tokens[k]] + r * E[mask]`` with ``r = max(0, 1 - sum_k probs[k])`` (``E`` its input
    embedding table), rescaled to the norm ``sum_k probs[k] * |E[tokens[k]]| + r * |E[mask]|`` (:func:`soft_embed`);
    every other column is embedded from its token as usual. The model learns nothing about the strategy; a model
    that takes these offers ``Cap.SOFT_INPUTS`` (core.capabilities).

    ``where`` ``[B, L]`` bool, ``tokens`` ``[B, L, K]`` long, ``probs`` ``[B, L, K]`` float (rows and columns of
    the call's canvas; values outside ``where`` are ignored); ``mix``: ``dinfer`` (the blend in float32, the norms
    of the embedding-dtype vectors, ``/ (|s| + 1e-6)``: dInfer's ``decode_uniform``) or ``diffulex`` (the blend in
    the embedding dtype, float32 norms, ``/ max(|s|, 1e-12)``: Diffulex's ``dmax_topk`` merge)."""

    where: torch.Tensor
    tokens: torch.Tensor
    probs: torch.Tensor
    mask_id: int
    mix: str = "dinfer"

    def take(self, rows: torch.Tensor) -> "SoftInputs":
        """The soft inputs of some rows of the batch."""
        return SoftInputs(self.where[rows], self.tokens[rows], self.probs[rows], self.mask_id, self.mix)

    def doubled(self) -> "SoftInputs":
        """The batch stacked twice (classifier-free guidance runs the conditional and unconditional rows)."""
        return SoftInputs(torch.cat([self.where, self.where]), torch.cat([self.tokens, self.tokens]),
                          torch.cat([self.probs, self.probs]), self.mask_id, self.mix)


def soft_embed(weight: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, mask_id: int,
               mix: str = "dinfer") -> torch.Tensor:
    """``[..., d]`` soft input embeddings (in ``weight``'s dtype) of ``tokens``/``probs`` ``[..., K]`` over the
    embedding table ``weight`` ``[V, d]`` (:class:`SoftInputs`): the probability-weighted mixture of the tokens'
    embeddings and the mask embedding (its share ``max(0, 1 - sum p)``), rescaled to the probability-weighted mean
    of their norms."""
    p = probs.float()
    if mix == "diffulex":
        p = p.clamp(0.0, 1.0)
    r = (1.0 - p.sum(-1)).clamp_min(0.0)                                 # [...]
    e = weight[tokens]                                                   # [..., K, d] (embedding dtype)
    em = weight[mask_id]                                                 # [d]
    if mix == "dinfer":
        n_tgt = (p * e.norm(dim=-1).float()).sum(-1) + r * em.norm().float()
        s = (p[..., None] * e.float()).sum(-2) + r[..., None] * em.float()
        out = s * (n_tgt / (s.norm(dim=-1) + 1e-6))[..., None]
        return out.to(weight.dtype)
    if mix == "diffulex":
        dt = weight.dtype
        pd, rd = p.to(dt), r.to(dt)
        n_tgt = ((p * e.float().norm(dim=-1)).sum(-1) + r * em.float().norm()).to(dt)
        s = (pd[..., None] * e).sum(-2) + rd[..., None] * em
        return s * (n_tgt / s.float().norm(dim=-1).clamp_min(1e-12).to(dt))[..., None]
    raise ValueError(f"soft input mix '{mix}' (choose {', '.join(SOFT_MIXES)})")


@dataclass
class CallRequest:
    """What the step loop asks of one model call besides the tokens."""

    gen_start: int = 0                            # first generated column (block-causal models count blocks from it)
    directive: Optional[CacheDirective] = None    # the step's block structure; None = the strategy gives none
    rows: Optional[torch.Tensor] = None           # rows of the full batch this call runs (ascending); None = all
    live: Optional[torch.Tensor] = None           # rows not finished (a superset of ``rows``); None = all. Rows
                                                  # outside ``live`` never come back; rows in ``live`` but not in
                                                  # ``rows`` only sit this step out (their block is done)
    full_batch: Optional[int] = None              # size of that full batch when ``rows`` is set (2B with CFG)
    aux: Optional[AuxColumns] = None              # extra query columns (needs a cache that offers AUX_COLUMNS)
    soft: Optional[SoftInputs] = None             # input embeddings for chosen columns (needs a model that offers
                                                  # Cap.SOFT_INPUTS: every bundled family)


@dataclass
class Columns:
    """Canvas columns that get a residual stream in a call: the span ``[start, end)`` for every row, or
    ``index`` (``[B, Q]`` canvas columns per row, ascending, the same count ``Q`` in every row)."""

    start: int
    end: int
    index: Optional[torch.Tensor] = None

    @classmethod
    def span(cls, start: int, end: int) -> "Columns":
        return cls(int(start), int(end))

    @classmethod
    def indexed(cls, index: torch.Tensor) -> "Columns":
        return cls(0, 0, index)

    @property
    def is_span(self) -> bool:
        return self.index is None

    @property
    def width(self) -> int:
        return int(self.index.shape[1]) if self.index is not None else self.end - self.start

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """Columns of ``t`` (``[B, L, ...]``) -> ``[B, Q, ...]``."""
        if self.index is None:
            return t[:, self.start:self.end]
        idx = self.index
        if t.dim() > 2:
            idx = idx.view(idx.shape + (1,) * (t.dim() - 2)).expand(idx.shape + t.shape[2:])
        return torch.gather(t, 1, idx)

    def canvas_ids(self, batch: int, device) -> torch.Tensor:
        """``[B, Q]`` canvas column of every computed position."""
        if self.index is not None:
            return self.index
        return torch.arange(self.start, self.end, device=device).expand(batch, -1)

    def as_tuple(self) -> Tuple[int, int]:
        """``(start, end)`` of a span (errors for index sets)."""
        if self.index is not None:
            raise ValueError("per-row column sets have no single span")
        return self.start, self.end


@dataclass
class ForwardCall:
    """One model call over a canvas. Column indices are canvas coordinates."""

    input_ids: torch.Tensor                       # [B, L] whole canvas
    position_ids: torch.Tensor                    # [B, L]
    key_mask: Optional[torch.Tensor]              # [B, L] bool, False = padding; None = no padding
    columns: Columns                              # columns fed through the layers (a cache may narrow them)
    logits_range: Tuple[int, int]                 # columns whose logits are wanted (the window)
    request: CallRequest = field(default_factory=CallRequest)
    logits_shift: int = 0                         # set by the model: column j's logits come from hidden j - shift
    attention_mode: str = "bidirectional"         # set by the model: bidirectional | block_causal
    block_size: Optional[int] = None              # set by the model: block-causal block size
    block_origin: Optional[int] = None            # set by the model: column where block 0 starts (None: the
                                                  # generation start, the prompt is block -1; 0: absolute blocks)
    shift_floor: Optional[int] = None             # set by the model: for a shifted model, column ``shift_floor``
                                                  # reads its own hidden state (the block-diffusion references
                                                  # shift within the queried block); None = 0
    logits: Optional[torch.Tensor] = None         # [B, hi - lo, V], set by the model (zeros where not valid)
    valid: Optional[torch.Tensor] = None          # [B, hi - lo] bool: logits computed in this call; None = all
    aux_logits: Optional[torch.Tensor] = None     # [B, W_aux, V] logits of request.aux
    refreshed: bool = False                       # set by a cache: this call recomputed and stored every column
    discard_draws: int = 0                        # set by a cache: noise draws the sampler makes and discards first
    computed: int = 0                             # set by the model: positions fed through the layers (all rows)
    recomputed: Optional[torch.Tensor] = None     # set by a cache that chooses positions per layer: [B, L] bool
                                                  # columns recomputed in the last layer (None: see recomputed_columns)
    layer_positions: int = 0                      # set by the model: positions projected in attention, summed
                                                  # over layers and rows (the work a cache left to do)
    memo: dict = field(default_factory=dict, repr=False)  # per-call scratch of the model (masks, column ids)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def directive(self) -> Optional[CacheDirective]:
        return self.request.directive

    @property
    def gen_start(self) -> int:
        return self.request.gen_start

    @property
    def compute(self) -> Tuple[int, int]:
        """``(start, end)`` of a span call (the common case of the block caches)."""
        return self.columns.as_tuple()


@dataclass
class AttentionIO:
    """One attention layer. The model fills ``x`` before the context; the cache may set ``query_cols`` and
    ``need_weights`` on entry; the model sets ``out`` (and ``weights``) inside; ``out`` covers all columns
    of the call after the context exits."""

    layer: int
    x: torch.Tensor                               # [B, T, d] attention-norm output of the call's columns
    call: ForwardCall
    project_v: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # x -> V [B, Hkv, n, D] (no RoPE)
    out_proj: Optional[Callable[[torch.Tensor], torch.Tensor]] = None   # the layer's output projection
    query_cols: Optional[torch.Tensor] = None     # [B, Q] columns of x that are projected and queried; None = all
    need_weights: bool = False                    # ask the model for head-averaged attention weights
    out: Optional[torch.Tensor] = None            # [B, Q or T, d] attention output (before the output projection)
    projected: bool = False                       # set by a cache on exit: ``out`` already went through
                                                  # ``out_proj`` (a cache that keeps projected outputs)
    weights: Optional[torch.Tensor] = None        # [B, Q, Tk] head-averaged attention weights (need_weights)
    key_columns: Optional[torch.Tensor] = None    # [Tk] or [B, Tk] canvas columns of the keys attended to


@dataclass
class FFNIO:
    """One feed-forward block: ``x`` is the residual stream entering it (all columns of the call)."""

    layer: int
    x: torch.Tensor                               # [B, T, d]
    call: ForwardCall
    cols: Optional[torch.Tensor] = None           # [B, Q] indices into x's columns computed; None = all (set by a
                                                  # cache on entry)
    out: Optional[torch.Tensor] = None            # [B, Q or T, d] FFN output before the residual add


def recomputed_columns(call: ForwardCall) -> torch.Tensor:
    """``[B, L]`` bool: the canvas columns whose keys/values ``call`` recomputed -- what the cache reported in
    :attr:`ForwardCall.recomputed`, else the columns that got a residual stream (:attr:`ForwardCall.columns`)."""
    if call.recomputed is not None:
        return call.recomputed
    B, L = call.input_ids.shape
    out = torch.zeros((B, L), dtype=torch.bool, device=call.input_ids.device)
    cols = call.columns
    if cols.is_span:
        out[:, cols.start:cols.end] = True
    else:
        out.scatter_(1, cols.index, True)
    return out


def key_padding_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Boolean key mask (False = padding), or None when nothing is padded so attention stays unmasked."""
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    return None if bool(mask.all()) else mask


class NullHooks:
    """No caching: every call computes every column; keys/values are the fresh ones."""

    @contextmanager
    def forward(self, call: ForwardCall) -> Iterator[ForwardCall]:
        yield call

    @contextmanager
    def attention(self, layer: int, io: AttentionIO) -> Iterator[AttentionIO]:
        yield io

    def keys_values(self, layer: int, io: AttentionIO, k: torch.Tensor, v: torch.Tensor):
        """Keys/values to attend to and their canvas columns (``None`` = the queried columns themselves)."""
        return k, v, None

    @contextmanager
    def ffn(self, layer: int, io: FFNIO) -> Iterator[FFNIO]:
        yield io


NULL_HOOKS = NullHooks()
