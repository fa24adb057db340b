"""End-of-sequence policies shared by strategies (docs/specs/strategies.md §2).

* ``suppress_ids``: LLaDA's ``logits_eos_inf`` -- the EOS logit is set to ``-inf`` before sampling (via
  :attr:`dlm_engine.core.strategy.StepPlan.suppress`), so EOS is never proposed.
* :func:`eos_eot_confidence`: LLaDA's ``confidence_eos_eot_inf`` quirk -- after the proposal is drawn, the
  EoT column (and, at ``T = 0`` only, the EOS column) of the clean logits is ``-inf`` when confidences are
  computed, so such proposals get confidence 0 and the others are renormalised without them.
* :func:`stop_at_eos`: the early stop -- a row ends once an EOS is committed and every generated position
  before it is decoded; its remaining masked positions are filled with EOS (the instruct models' own
  padding) in the same delta, and the row is marked finished.

The ids come from the model config (``Canvas.eos_id`` / ``Canvas.eot_id``), never hard-coded.

Strategies offer the three options by mixing :class:`EosOptions` into their config dataclass and calling
:func:`check_eos_options` (``init_state``), :func:`eos_suppress` (``plan``), :func:`eos_confidence` (the confidences to rank by) and
:func:`eos_stop` (``select``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dlm_engine.core.canvas import Canvas, FrameDelta
from dlm_engine.errors import ConfigError
from dlm_engine.core.sampler import confidence_of, suppress_
from dlm_engine.core.selection import first_true


@dataclass
class EosOptions:
    """The EOS options of a strategy config (a mixin for config dataclasses)."""

    logits_eos_inf: bool = False          # EOS logit -> -inf before sampling (EOS is never proposed)
    confidence_eos_eot_inf: bool = False  # EoT (and EOS at T = 0) proposals get confidence 0 (LLaDA quirk)
    stop_at_eos: bool = False             # end a row once EOS is committed and everything before it is decoded


def check_eos_options(cfg, canvas: Canvas) -> None:
    """Raise :class:`ConfigError` naming the option when the model lacks the id an enabled option needs."""
    if cfg.logits_eos_inf or cfg.stop_at_eos:
        require_id(canvas, "eos", "strategy.logits_eos_inf" if cfg.logits_eos_inf else "strategy.stop_at_eos")
    if cfg.confidence_eos_eot_inf and canvas.eos_id is None and canvas.eot_id is None:
        require_id(canvas, "eos", "strategy.confidence_eos_eot_inf")


def eos_suppress(cfg, canvas: Canvas) -> Tuple[int, ...]:
    """``StepPlan.suppress`` for ``logits_eos_inf``."""
    return (canvas.eos_id,) if cfg.logits_eos_inf else ()


def eos_confidence(cfg, canvas: Canvas, plan, proposal) -> torch.Tensor:
    """The proposal's confidences, recomputed under ``confidence_eos_eot_inf`` (not for random ranking)."""
    if cfg.confidence_eos_eot_inf and plan.confidence != "random":
        conf = eos_eot_confidence(proposal.logits, proposal.x0, plan.confidence, plan.softmax_dtype,
                                  plan.temperature, canvas.eos_id, canvas.eot_id)
        return conf if proposal.valid is None else conf.masked_fill(~proposal.valid, float("-inf"))
    return proposal.confidence


def eos_stop(cfg, canvas: Canvas, delta: FrameDelta) -> FrameDelta:
    """``stop_at_eos``: :func:`stop_at_eos` when enabled, else ``delta`` unchanged."""
    return stop_at_eos(canvas, delta, canvas.eos_id) if cfg.stop_at_eos else delta


def require_id(canvas: Canvas, which: str, key: str) -> int:
    value = getattr(canvas, f"{which}_id", None)
    if value is None:
        raise ConfigError(f"{key} needs the model's {which}_token_id, which this model does not define")
    return int(value)


def eos_eot_confidence(logits: torch.Tensor, x0: torch.Tensor, kind: str, softmax_dtype: str, temperature: float,
                       eos_id: Optional[int], eot_id: Optional[int]) -> torch.Tensor:
    """Confidences with the EoT column (and the EOS column at ``T = 0``) of the clean logits at ``-inf``."""
    cols = [c for c in ((eot_id,) + ((eos_id,) if temperature == 0 else ())) if c is not None]
    if not cols:
        return confidence_of(logits, x0, kind, softmax_dtype)
    return confidence_of(suppress_(logits.clone(), cols), x0, kind, softmax_dtype)


def stop_at_eos(canvas: Canvas, delta: FrameDelta, eos_id: int) -> FrameDelta:
    """Finish rows whose generation has an EOS with every position before it decoded (after ``delta``).

    Returns a copy widened to ``[min(start, gen_start), L)`` that also commits EOS at the finishing rows'
    remaining masked generated positions (built whether or not a row finishes: no host read).
    """
    g, L = canvas.gen_start, canvas.length
    s, W = delta.start, delta.width
    lo = min(s, g)
    finished = delta.finished
    B = canvas.batch_size
    # the canvas after this delta, over columns [lo, L)
    commit = torch.zeros((B, L - lo), dtype=torch.bool, device=canvas.device)
    commit[:, s - lo:s - lo + W] = delta.commit
    tokens = canvas.tokens[:, lo:].clone()
    tokens[:, s - lo:s - lo + W] = torch.where(delta.commit, delta.tokens, tokens[:, s - lo:s - lo + W])
    masked = canvas.masked_cols(lo)                  # (a fresh tensor: written below)
    if delta.remask is not None:
        masked[:, s - lo:s - lo + W] |= delta.remask
    masked &= ~commit
    gen_tok, gen_masked = tokens[:, g - lo:], masked[:, g - lo:]
    is_eos = (gen_tok == eos_id) & ~gen_masked
    G = gen_tok.shape[1]
    col = torch.arange(G, device=canvas.device)
    first = first_true(is_eos, G)
    open_before = (gen_masked & (col[None, :] < first[:, None])).any(-1)
    done = (first < G) & ~open_before & ~canvas.finished & ~finished
    fill = torch.zeros_like(commit)
    fill[:, g - lo:] = gen_masked & done[:, None] & (col[None, :] > first[:, None])
    out_tokens = canvas.tokens[:, lo:].clone()
    out_tokens[:, s - lo:s - lo + W] = delta.tokens
    out_tokens = torch.where(fill, torch.full_like(out_tokens, eos_id), out_tokens)
    conf = remask = None
    if delta.confidence is not None:
        conf = torch.zeros((B, L - lo), dtype=delta.confidence.dtype, device=canvas.device)
        conf[:, s - lo:s - lo + W] = delta.confidence
    if delta.remask is not None:
        remask = torch.zeros_like(commit)
        remask[:, s - lo:s - lo + W] = delta.remask
    return FrameDelta(step=delta.step, nfe=delta.nfe, start=lo, commit=commit | fill, tokens=out_tokens,
                      active=delta.active, finished=finished | done, confidence=conf, remask=remask,
                      block_events=delta.block_events, scalars=dict(delta.scalars, eos_stop=done),
                      wall_time=delta.wall_time)
