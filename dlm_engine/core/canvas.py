"""The canvas being decoded and the per-step delta every strategy emits."""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch


Scalar = Union[int, float, bool, torch.Tensor]


@dataclass(frozen=True)
class BlockEvent:
    """A block-level event: ``kind`` is ``opened``, ``admitted``, ``completed`` or ``stored``.

    ``block`` is the generation-relative block index, ``start``/``end`` its canvas columns, ``row`` the
    batch row (-1 = every row).
    """

    kind: str
    block: int
    start: int
    end: int
    row: int = -1


@dataclass(frozen=True)
class ModelInfo:
    """What a strategy may know about the model a canvas is decoded with (set by the loop)."""

    model_type: Optional[str] = None      # config.json model_type: "llada", "Dream", ...
    logits_shift: int = 0                 # 1 for models that predict column j from hidden state j - 1 (Dream)

    @classmethod
    def of(cls, model) -> "ModelInfo":
        """The model's info, remembered per model object (a config attribute read costs ~8 us and every decode
        asks)."""
        try:
            return _MODEL_INFO[model]
        except (KeyError, TypeError):      # (TypeError: a model that cannot be weakly referenced)
            pass
        info = cls(getattr(getattr(model, "config", None), "model_type", None), int(getattr(model, "logits_shift", 0)))
        try:
            _MODEL_INFO[model] = info
        except TypeError:
            pass
        return info


NO_MODEL_INFO = ModelInfo()                # a canvas' info until the loop sets the model's
_MODEL_INFO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=64)
def _all_rows(batch: int, device: torch.device) -> torch.Tensor:
    """``[batch]`` bool, all True: one read-only tensor per batch size and device, shared by every canvas (a decode of
    one step would otherwise spend a kernel a decode making its own)."""
    return torch.ones(batch, dtype=torch.bool, device=device)


@functools.lru_cache(maxsize=64)
def _no_rows(batch: int, device: torch.device) -> torch.Tensor:
    """``[batch]`` bool, all False: shared and read-only as :func:`_all_rows`."""
    return torch.zeros(batch, dtype=torch.bool, device=device)


@dataclass
class FrameDelta:
    """What one step changed. Tensors cover canvas columns ``[start, start + W)``.

    ``finished`` marks rows that are done after this step (explicit, never inferred from empty
    tensors). ``remask`` marks positions returned to the mask state (applied before ``commit``).
    ``nfe`` is the number of forward passes this step spent. Step 0 (``nfe`` 0) is a strategy's set-up
    before decoding (constraints, an initial canvas): its commits count as given tokens.
    """

    step: int
    nfe: int
    start: int
    commit: torch.Tensor                       # [B, W] bool
    tokens: torch.Tensor                       # [B, W] long, meaningful where commit
    active: torch.Tensor                       # [B] bool: rows that took part in this step
    finished: torch.Tensor                     # [B] bool: rows finished after this step
    confidence: Optional[torch.Tensor] = None  # [B, W] float (float32 or float64), confidence of the proposals
    remask: Optional[torch.Tensor] = None      # [B, W] bool
    block_events: List[BlockEvent] = field(default_factory=list)
    scalars: Dict[str, Scalar] = field(default_factory=dict)
    wall_time: float = 0.0                     # seconds since decode start (host clock, no sync)
    # [B, W, V] the proposal's logits; set by the loop only when a sink has ``wants_logits = True``.
    # Sinks may keep references to a delta's tensors: nothing mutates them after the delta is emitted.
    logits: Optional[torch.Tensor] = None
    @property
    def width(self) -> int:
        return int(self.commit.shape[1])


class Canvas:
    """Token ids and commit steps of a left-padded batch.

    ``step_of[b, i]``: -1 while masked, 0 for given tokens (padding, prompt, constraints), ``t >= 1`` for a
    token committed by step ``t``. The state after step ``t`` is therefore
    ``where((step_of >= 0) & (step_of <= t), tokens, mask_id)``.
    """

    def __init__(self, tokens: torch.Tensor, step_of: torch.Tensor, attention_mask: torch.Tensor,
                 gen_start: int, mask_id: int, eos_id: Optional[int] = None, eot_id: Optional[int] = None):
        self.tokens = tokens
        self.step_of = step_of
        self.attention_mask = attention_mask
        self.gen_start = int(gen_start)
        self.mask_id = int(mask_id)
        # the model's end-of-sequence / end-of-turn ids (None = unknown): EOS policies and early stops read them
        self.eos_id = None if eos_id is None else int(eos_id)
        self.eot_id = None if eot_id is None else int(eot_id)
        self.finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        self.step = 0
        self.nfe = 0
        # forwards per row: a device count for steps some rows sat out, plus (on the host, no kernel) the steps
        # every row took part in (a delta whose ``active`` is :meth:`every_row`); read as ``row_nfe``
        self._row_nfe = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
        self._nfe_every_row = 0
        self._every_row: Optional[torch.Tensor] = None
        self._no_rows: Optional[torch.Tensor] = None
        self.position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        # left padding per row, on the host (read once here: rows are ranked as in a batch of one)
        self.pads = tuple(int(n) for n in (~attention_mask.bool()).sum(-1).tolist())
        self.is_padded = any(self.pads)
        self.model_info = NO_MODEL_INFO

    @classmethod
    def from_prompts(cls, prompts: Sequence[Sequence[int]], gen_length: int, mask_id: int, pad_id: int,
                     device: Union[str, torch.device] = "cpu", eos_id: Optional[int] = None,
                     eot_id: Optional[int] = None) -> "Canvas":
        if not prompts:
            raise ValueError("no prompts")
        P = max(len(p) for p in prompts)
        B, L = len(prompts), P + gen_length
        tokens = torch.full((B, L), pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.bool)
        for i, p in enumerate(prompts):
            if len(p):
                tokens[i, P - len(p):P] = torch.as_tensor(list(p), dtype=torch.long)
            attn[i, P - len(p):] = True
        tokens[:, P:] = mask_id
        step_of = torch.zeros((B, L), dtype=torch.int32)
        step_of[:, P:] = -1
        canvas = cls(tokens.to(device), step_of.to(device), attn.to(device), P, mask_id, eos_id=eos_id, eot_id=eot_id)
        return canvas

    # -- views -------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def gen_length(self) -> int:
        return self.length - self.gen_start

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def masked(self) -> torch.Tensor:
        return self.step_of < 0

    def given(self) -> torch.Tensor:
        """Positions present before decoding started (prompt, padding, constraints)."""
        return self.step_of == 0

    def state_at(self, t: int) -> torch.Tensor:
        keep = (self.step_of >= 0) & (self.step_of <= t)
        return torch.where(keep, self.tokens, torch.full_like(self.tokens, self.mask_id))

    @property
    def row_nfe(self) -> torch.Tensor:
        """``[B]`` long: the forwards each row took part in (a finished row takes part in none)."""
        return self._row_nfe + self._nfe_every_row if self._nfe_every_row else self._row_nfe

    def every_row(self) -> torch.Tensor:
        """``[B]`` bool, all True (never write to it: canvases of one batch size share it): the step loop passes it
        as the rows of a call that runs every row, so :meth:`apply` counts that step's NFE on the host."""
        if self._every_row is None:
            self._every_row = _all_rows(self.batch_size, self.device)
        return self._every_row

    def no_rows(self) -> torch.Tensor:
        """``[B]`` bool, all False (never write to it: shared like :meth:`every_row`): the ``finished`` of a delta
        that finishes no row, known on the host; :meth:`apply` then leaves ``finished`` alone (no operation)."""
        if self._no_rows is None:
            self._no_rows = _no_rows(self.batch_size, self.device)
        return self._no_rows

    def cols(self, start: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(tokens[:, start:end], step_of[:, start:end])``: views (a write through them changes the canvas)."""
        return self.tokens[:, start:end], self.step_of[:, start:end]

    def masked_cols(self, start: int, end: Optional[int] = None) -> torch.Tensor:
        """``masked()[:, start:end]`` as a fresh tensor (``end`` None: the canvas' end)."""
        return self.cols(start, self.length if end is None else end)[1] < 0

    # -- update ------------------------------------------------------------------------------------
    def apply(self, delta: FrameDelta) -> None:
        """Apply ``delta``."""
        s = delta.start
        tok, so = self.cols(s, s + delta.width)
        if delta.remask is not None:
            tok.masked_fill_(delta.remask, self.mask_id)
            so.masked_fill_(delta.remask, -1)
        new = delta.tokens if delta.tokens.dtype == tok.dtype else delta.tokens.to(tok.dtype)
        torch.where(delta.commit, new, tok, out=tok)     # in place, one kernel
        so.masked_fill_(delta.commit, delta.step)
        fin = delta.finished
        if fin is not None and fin is not self._no_rows:
            self.finished |= fin
        self.step = delta.step
        self.nfe += delta.nfe
        if delta.nfe:
            if delta.active is self._every_row:
                self._nfe_every_row += delta.nfe
            else:
                self._row_nfe.add_(delta.active, alpha=delta.nfe)
