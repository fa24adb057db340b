"""What a strategy is: a small policy with ``plan`` (what to query) and ``select`` (what to commit).

The step loop (:mod:`dlm_engine.core.loop`) owns the forward pass, the cache and the sampler; strategies
only look at the canvas and the proposal and return a :class:`FrameDelta` plus their new state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from dlm_engine.core.canvas import BlockEvent, Canvas, FrameDelta
from dlm_engine.errors import ConfigError
from dlm_engine.core.sampler import Proposal


@dataclass
class CacheDirective:
    """Block structure a cache needs to decide what to recompute.

    ``block``: the block being decoded (canvas columns); ``block_start``: first step of that block;
    ``store``: completed blocks whose keys/values may be stored for good (block buffer).
    ``stored``: filled by the cache during the forward with the ``store`` ranges it actually stored, so
    the strategy can report them as ``stored`` block events (stays empty with caches that store nothing).
    """

    block: Tuple[int, int]
    block_start: bool
    step_in_block: int = 0
    store: List[Tuple[int, int]] = field(default_factory=list)
    stored: List[Tuple[int, int]] = field(default_factory=list)


@dataclass
class StepPlan:
    window: Tuple[int, int]              # canvas columns whose proposals are needed
    temperature: float = 0.0
    confidence: str = "prob"
    softmax_dtype: str = "model"
    top_v: Optional[int] = None
    cfg_scale: float = 0.0
    cache: Optional[CacheDirective] = None
    info: Dict[str, Any] = field(default_factory=dict)
    suppress: Tuple[int, ...] = ()       # token ids whose logits are set to -inf before sampling (e.g. EOS)


class Strategy:
    """Base class. Subclasses are registered with :func:`dlm_engine.core.registry.register_strategy`."""

    name: ClassVar[str] = ""
    Config: ClassVar[type] = object
    max_batch: ClassVar[Optional[int]] = None            # None = any batch size
    caches: ClassVar[Sequence[str]] = ("none",)          # cache names this strategy works with

    def __init__(self, config: Any, gen_length: int):
        self.cfg = config
        self.gen_length = int(gen_length)
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; raise :class:`ConfigError` naming the keys."""

    def init_state(self, canvas: Canvas) -> Any:
        return None

    def plan(self, canvas: Canvas, state: Any) -> Optional[StepPlan]:
        raise NotImplementedError

    def select(self, canvas: Canvas, plan: StepPlan, proposal: Proposal, state: Any) -> Tuple[FrameDelta, Any]:
        raise NotImplementedError

    # -- helpers shared by strategies --------------------------------------------------------------
    def check_unit_interval(self, key: str, value: Optional[float], allow_none: bool = False) -> None:
        if value is None:
            if allow_none:
                return
            raise ConfigError(f"strategy.{key} must be set")
        if not (0.0 < float(value) <= 1.0):
            raise ConfigError(f"strategy.{key}={value} is outside (0, 1]")

    def check_positive(self, key: str, value: Optional[int]) -> None:
        if value is None or int(value) <= 0:
            raise ConfigError(f"strategy.{key}={value} must be a positive integer")

    def check_choice(self, key: str, value: Any, options: Sequence[str]) -> None:
        if value not in options:
            choices = ", ".join(options[:-1]) + " or " + options[-1]
            raise ConfigError(f"strategy.{key}='{value}' (choose {choices})")

    def check_non_negative(self, key: str, value: float) -> None:
        if value < 0:
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
    def delta(canvas: Canvas, proposal: Proposal, commit: torch.Tensor, *, nfe: int = 1,
              active: Optional[torch.Tensor] = None, events: Optional[List[BlockEvent]] = None,
              scalars: Optional[dict] = None, finished: Optional[torch.Tensor] = None,
              tokens: Optional[torch.Tensor] = None) -> FrameDelta:
        """A delta committing ``commit`` (window-shaped) with the proposal's tokens and confidences."""
        s, W = proposal.start, commit.shape[1]
        if active is None:
            active = ~canvas.finished
        if finished is None:
            still = canvas.masked()[:, canvas.gen_start:].clone()
            still[:, s - canvas.gen_start:s - canvas.gen_start + W] &= ~commit
            finished = ~still.any(dim=-1) & ~canvas.finished
        return FrameDelta(
            step=canvas.step + 1, nfe=nfe, start=s, commit=commit,
            tokens=proposal.x0 if tokens is None else tokens,
            active=active, finished=finished, confidence=proposal.confidence.float(),
            block_events=list(events or []), scalars=dict(scalars or {}),
        )


@dataclass
class BlockCursor:
    """Position of a semi-autoregressive block decoder: block index, step within the block, schedule."""

    block: int = 0
    step: int = 0
    schedule: Optional[torch.Tensor] = None   # [B, steps_per_block] tokens to commit per step
    opened: bool = False


def block_range(canvas: Canvas, block: int, block_length: int) -> Tuple[int, int]:
    s = canvas.gen_start + block * block_length
    return s, s + block_length


def candidates(canvas: Canvas, proposal: Proposal, end: int) -> torch.Tensor:
    """Masked positions of the window that lie before ``end`` (the end of the current block)."""
    s = proposal.start
    W = proposal.x0.shape[1]
    cand = canvas.masked()[:, s:s + W].clone()
    if end < s + W:
        cand[:, max(0, end - s):] = False
    return cand
