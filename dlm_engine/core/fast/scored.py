"""Confidences at a window's masked positions only (``StepPlan.masked``; see :mod:`dlm_engine.core.fast`)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from dlm_engine.core import sampler
from dlm_engine.core.canvas import Canvas


def scored_window(logits: torch.Tensor, plan, canvas: Canvas, rows: Optional[torch.Tensor] = None,
                  run: Optional[Tuple[bool, ...]] = None):
    """``(scored, mask)``: what :func:`dlm_engine.core.sampler.propose` takes as ``scored`` to compute confidences
    at the window's masked positions only (their number per row, ``plan.masked``, is known on the host; ``run``:
    the host flags of the call's ``rows``), and the window's full-batch mask (handed on as ``Proposal.masked``);
    ``(None, None)`` where that does not pay (``sampler.scoring_pays_off``) or would not give the same bits (a
    confidence kind outside ``sampler.ROW_EXACT_KINDS``). The float64 softmax over the vocabulary is the costliest
    part of a step outside the model: measured in docs/decisions/scored_confidences.md."""
    if plan.confidence not in sampler.ROW_EXACT_KINDS:
        return None, None
    start = plan.window[0]
    B, W, V = logits.shape
    count = sum(plan.masked) if rows is None else sum(n for n, f in zip(plan.masked, run) if f)
    if not sampler.scoring_pays_off(B * W - count, V, plan.top_v, logits.device):
        return None, None
    mask, held = canvas.masked_cols(start, start + W), canvas.cols(start, start + W)[0]
    return ((mask, count, held) if rows is None else (mask[rows], count, held[rows])), mask
