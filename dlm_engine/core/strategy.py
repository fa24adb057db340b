"""What a strategy is: a small, pure policy with ``plan`` (what to query) and ``select`` (what to commit).

The step loop (:mod:`dlm_engine.core.loop`) owns the forward pass, the cache and the sampler; strategies
only look at the canvas and the proposal and return a :class:`FrameDelta` plus their new state. ``plan``
and ``select`` take the state and return the new state; neither mutates the canvas, the proposal, the
old state or the strategy object. Canvas changes a strategy needs before the first step (constraints, an
initial canvas) are a step-0 delta returned by :meth:`Strategy.prepare`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch

from dlm_engine.core.canvas import BlockEvent, Canvas, FrameDelta
from dlm_engine.core.capabilities import Cap, Caps, caps
from dlm_engine.core.confidence import PROBABILITY, ConfidenceKind, Remasking  # noqa: F401  (Remasking re-exported)
from dlm_engine.core.protocol import AuxColumns, CacheDirective, SoftInputs
from dlm_engine.core.sampler import Proposal
from dlm_engine.errors import ConfigError

__all__ = ["Strategy", "StepPlan", "CacheDirective", "BlockCursor", "Remasking", "block_range", "candidates", "evolve",
           "frame", "masked_after"]


@dataclass
class StepPlan:
    """What one step needs from the loop: the window of proposals, how to sample them, the cache directive."""

    window: Tuple[int, int]              # canvas columns whose proposals are needed
    temperature: float = 0.0
    confidence: str = "prob"
    softmax_dtype: str = "model"
    top_v: Optional[int] = None
    cfg_scale: float = 0.0
    cache: Optional[CacheDirective] = None
    data: Any = None                     # the strategy's own plan data for its select (a frozen dataclass of its
                                         # module, e.g. ``low_confidence.TransferPlan``); the loop never reads it
    suppress: Tuple[int, ...] = ()       # token ids whose logits are set to -inf before sampling (e.g. EOS)
    sample: bool = True                  # False: the proposal carries the call rows' logits only (the strategy
                                         # samples itself; ``Proposal.rows`` names the rows)
    aux: Optional[AuxColumns] = None     # extra query columns for this call (needs Cap.AUX_COLUMNS)
    rows: Optional[Sequence[bool]] = None  # per row, on the host: takes part in this step (None = every unfinished row)
    position_ids: Optional[torch.Tensor] = None   # [B, L] position ids for this call (None = the canvas')
    # per row, on the host: the masked positions of the window. Set it when only masked positions can be
    # committed: confidences are then computed there only (the float64 softmax over the vocabulary is the
    # costliest part of a step outside the model), the others are -inf; at T = 0 so are the proposals (``x0``
    # elsewhere is the token the position holds)
    masked: Optional[Sequence[int]] = None
    soft: Optional[SoftInputs] = None    # input embeddings for chosen columns (needs a model offering Cap.SOFT_INPUTS:
                                         # declare it in the strategy's ``model_needs``)


@dataclass(frozen=True)
class BlockCursor:
    """Position of a semi-autoregressive block decoder: the block and the steps taken in it."""

    block: int = 0
    step: int = 0

    def advance(self, bounds: Tuple[int, int], done: bool) -> Tuple["BlockCursor", List[BlockEvent]]:
        """The cursor after one step in block ``bounds`` (canvas columns) and the step's block events:
        ``opened`` on the block's first step, ``completed`` when ``done`` (the next step opens the next block)."""
        s, e = bounds
        events = [BlockEvent("opened", self.block, s, e)] if self.step == 0 else []
        if done:
            events.append(BlockEvent("completed", self.block, s, e))
            return BlockCursor(self.block + 1, 0), events
        return BlockCursor(self.block, self.step + 1), events


class Strategy:
    """Base class. Subclasses are registered with :func:`dlm_engine.core.registry.register_strategy`.

    ``offers``: facts about every step a cache may rely on; ``needs``: what a cache must offer
    (:mod:`dlm_engine.core.capabilities`). Both may be set per instance in :meth:`validate`.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type] = object
    max_batch: ClassVar[Optional[int]] = None            # None = any batch size
    offers: Caps = caps()
    needs: Caps = caps(Cap.BLOCK_LOGITS)
    model_needs: Caps = caps()                           # what the model must offer (e.g. Cap.SOFT_INPUTS)

    def __init__(self, config: Any, gen_length: int):
        self.cfg = coerce_choices(config)
        self.gen_length = int(gen_length)
        self.validate()

    def cache_hint(self, cache) -> Optional[str]:
        """A setting of this strategy that would make it pair with ``cache``, said after a refusal (None: none)."""
        return None

    @property
    def label(self) -> str:
        """How messages name the strategy: the preset the user picked (``strategy=pc_sampler`` runs ``d2c`` with
        ``preset: pc_sampler``), else its registered name."""
        return getattr(self.cfg, "preset", None) or self.name

    # -- the policy ------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Cross-field checks; raise :class:`ConfigError` naming the keys."""

    def prepare(self, canvas: Canvas) -> Optional[FrameDelta]:
        """Canvas changes before the first step, as a step-0 delta (None = nothing to change)."""
        return None

    def init_state(self, canvas: Canvas) -> Any:
        return None

    def plan(self, canvas: Canvas, state: Any) -> Tuple[Optional[StepPlan], Any]:
        """The next step's plan (None = done) and the new state."""
        raise NotImplementedError

    def select(self, canvas: Canvas, plan: StepPlan, proposal: Proposal, state: Any) -> Tuple[FrameDelta, Any]:
        """The step's delta and the new state."""
        raise NotImplementedError

    def reads(self, canvas: Canvas, state: Any) -> Union[None, torch.Tensor, Sequence[torch.Tensor]]:
        """What the next plan must know on the host, counted on the canvas once the step's delta is applied (and
        before the first step): a small tensor (masked positions per block, flags, ...) or a list of them, flattened
        and read in order. The step loop reads it together with the finished rows in its one host transfer of the
        step and hands the numbers to :meth:`settle` (``cat`` promotes: with an int part, flags read as 0/1; with a
        float part, every value is a float; on the first forward's step the loop's health values are float, and it
        hands back ints for a request that had no float part). None = nothing to read."""
        return None

    def settle(self, canvas: Canvas, state: Any, values: List[float], delta: Optional[FrameDelta]) -> Any:
        """The state once the host knows ``values`` (what :meth:`reads` asked for, flattened). ``delta`` is the
        step's delta before the sinks see it (None for the read before the first step): a strategy may add block
        events it decides here (a block the step filled)."""
        return state

    def max_steps(self, canvas: Canvas) -> int:
        """Steps after which the loop gives up (a strategy that cannot stall may lower or raise it)."""
        return 4 * canvas.gen_length + 64

    # -- helpers shared by strategies --------------------------------------------------------------
    def check_unit_interval(self, key: str, value: Optional[float], allow_none: bool = False) -> None:
        if value is None:
            if allow_none:
                return
            raise ConfigError(f"strategy.{key} must be set")
        if not (0.0 < float(value) <= 1.0):
            raise ConfigError(f"strategy.{key}={value} is outside (0, 1]")

    def check_threshold(self, key: str, value: Optional[float], kind: ConfidenceKind = PROBABILITY,
                        allow_none: bool = False) -> None:
        """A threshold compared with confidences of ``kind`` (default: probabilities, ``(0, 1]``): one this kind
        can both reach and fail (:class:`~dlm_engine.core.confidence.ConfidenceKind`; docs/thresholds.md)."""
        kind.check(key, value, allow_none)

    def check_positive(self, key: str, value: Optional[int]) -> None:
        if value is None or int(value) <= 0:
            raise ConfigError(f"strategy.{key}={value} must be a positive integer")

    def check_non_negative(self, key: str, value: float) -> None:
        if value is None or not float(value) >= 0:
            raise ConfigError(f"strategy.{key}={value} must be >= 0")

    def check_steps_per_block(self, steps: int, num_blocks: int) -> int:
        """``steps`` is the total over all blocks: a positive multiple of ``num_blocks``; returns steps per block."""
        if steps <= 0:
            raise ConfigError(f"strategy.steps={steps} must be a positive integer")
        if steps % num_blocks != 0:
            raise ConfigError(f"strategy.steps={steps} is not divisible by the number of blocks "
                              f"(gen_length/strategy.block_length = {num_blocks})")
        return steps // num_blocks

    def block_length_or_gen(self, value: Optional[int], key: str = "block_length") -> int:
        bl = self.gen_length if value is None else int(value)
        if bl <= 0:
            raise ConfigError(f"strategy.{key}={value} must be a positive integer")
        if self.gen_length % bl != 0:
            raise ConfigError(f"gen_length={self.gen_length} is not divisible by strategy.{key}={bl}")
        return bl

    @staticmethod
    def delta(canvas: Canvas, proposal: Proposal, commit: torch.Tensor, *, confidence: Optional[torch.Tensor] = None,
              tokens: Optional[torch.Tensor] = None, remask: Optional[torch.Tensor] = None,
              finished: Optional[torch.Tensor] = None, events: Optional[List[BlockEvent]] = None,
              scalars: Optional[dict] = None) -> FrameDelta:
        """A delta over the proposal's window committing ``commit`` (and re-masking ``remask``, applied first) with
        the proposal's tokens and confidences (or ``tokens``, ``confidence``), for the rows of the call. Unless
        given, ``finished`` marks the rows that have no masked generated position left once the delta is applied
        (and were not finished before)."""
        if finished is None:       # ~left & ~finished, as one reduction and two in-place ops
            finished = masked_after(canvas, proposal.start, commit, remask).any(dim=-1).logical_or_(
                canvas.finished).logical_not_()
        return frame(canvas, proposal, commit, finished, confidence=confidence, tokens=tokens, remask=remask,
                     events=events, scalars=scalars)


def frame(canvas: Canvas, proposal: Proposal, commit: torch.Tensor, finished: torch.Tensor, *,
          confidence: Optional[torch.Tensor] = None, tokens: Optional[torch.Tensor] = None,
          remask: Optional[torch.Tensor] = None, events: Optional[List[BlockEvent]] = None,
          scalars: Optional[dict] = None) -> FrameDelta:
    """The :class:`FrameDelta` of :meth:`Strategy.delta` with ``finished`` as given."""
    active = proposal.active if proposal.active is not None else ~canvas.finished
    conf = proposal.confidence if confidence is None else confidence   # (float64 or float32: sinks cast)
    return FrameDelta(
        step=canvas.step + 1, nfe=1, start=proposal.start, commit=commit,
        tokens=proposal.x0 if tokens is None else tokens, active=active, finished=finished, confidence=conf,
        remask=remask, block_events=list(events or []), scalars=dict(scalars or {}))


def evolve(state, **changes):
    """A frozen state dataclass with ``changes`` (``dataclasses.replace`` without its per-call walk over the fields
    and ``__init__``: states change every step). A name that is not a field is a TypeError, as with replace."""
    fields = type(state).__dataclass_fields__
    for k in changes:
        if k not in fields:
            raise TypeError(f"{type(state).__name__} has no field '{k}'")
    new = object.__new__(type(state))
    d = new.__dict__
    d.update(state.__dict__)
    d.update(changes)
    return new


def masked_after(canvas: Canvas, start: int, commit: torch.Tensor, remask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, G]`` masked generated positions once a delta over ``[start, start + W)`` is applied."""
    g = canvas.gen_start
    still = canvas.masked_cols(g)                   # canvas.masked() of the generation, a fresh tensor
    a = start - g
    W = commit.shape[1]
    lo, hi = max(a, 0), min(a + W, still.shape[1])
    if hi > lo:
        part = still[:, lo:hi]                      # a view: the in-place ops below write into ``still``
        whole = lo == a and hi - lo == W
        if remask is not None:
            part |= remask if whole else remask[:, lo - a:hi - a]
        part &= ~(commit if whole else commit[:, lo - a:hi - a])
    return still


def block_range(canvas: Canvas, block: int, block_length: int) -> Tuple[int, int]:
    s = canvas.gen_start + block * block_length
    return s, s + block_length


def candidates(canvas: Canvas, proposal: Proposal, end: int) -> torch.Tensor:
    """Masked positions of the window that lie before ``end`` (the end of the current block) and whose
    logits the call computed (a cache may leave some columns out: ``Proposal.valid``). The proposal's own
    ``masked`` (the loop's comparison for the sampler) is read, never written: callers must not write into the
    result either."""
    s = proposal.start
    W = proposal.x0.shape[1]
    if proposal.masked is None:
        cand = canvas.masked_cols(s, s + W)          # canvas.masked() of the window, a fresh tensor
    elif end < s + W or proposal.valid is not None:
        cand = proposal.masked.clone()               # (written to below)
    else:
        return proposal.masked
    if end < s + W:
        cand[:, max(0, end - s):] = False
    if proposal.valid is not None:
        cand &= proposal.valid
    return cand


def coerce_choices(config: Any, group: str = "strategy") -> Any:
    """A copy of a config dataclass whose Enum-typed fields hold Enum members (a plain string from Python
    code is looked up; an unknown one is a :class:`ConfigError` naming the key and the choices), and whose
    float fields are finite."""
    if not dataclasses.is_dataclass(config):
        return config
    changes = {}
    hints = _field_types(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kind = hints.get(f.name)
        if isinstance(kind, type) and issubclass(kind, Enum) and value is not None and not isinstance(value, kind):
            try:
                changes[f.name] = kind(value)
            except ValueError:
                choices = ", ".join(m.value for m in kind)
                raise ConfigError(f"{group}.{f.name}='{value}' (choose {choices})") from None
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{group}.{f.name}={value} must be a finite number")
    return dataclasses.replace(config, **changes) if changes else config


@functools.lru_cache(maxsize=None)
def _field_types(cls) -> Dict[str, Any]:
    import typing

    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # pragma: no cover - unresolvable annotations: no coercion
        return {}
    out = {}
    for k, v in hints.items():
        args = [a for a in typing.get_args(v) if a is not type(None)]
        out[k] = args[0] if typing.get_origin(v) is typing.Union and len(args) == 1 else v
    return out
