"""Adaptive decoding rules (CadLLM, spec §6.1-6.3), as pure functions of the confidence history.

``history`` is the sequence of per-step mean confidences, ``recent`` the most recently committed token
ids. The arithmetic reproduces the reference exactly: float32 means (torch's in the reference) of
``history[-2:]`` for block size and step budget, a float64 numpy mean of ``history[-5:]`` for the vocabulary size, ``int()``
truncations.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def f32_mean(xs: Sequence[float]) -> float:
    """The float32 mean the reference takes with torch (of at most two values here: the same rounding), in
    numpy: host numbers stay off the tensor library."""
    return float(np.mean(np.asarray(list(xs), dtype=np.float32), dtype=np.float32))


def repetition_score(recent: Sequence[int], window: int = 8) -> float:
    """1.0 if the last 4 tokens are equal, else the longest repeated tail pattern length / window (0 = none)."""
    if len(recent) < window:
        return 0.0
    r = list(recent[-window:])
    if len(set(r[-4:])) == 1:
        return 1.0
    return max((n / window for n in range(2, window // 2 + 1) if r[-n:] == r[-2 * n:-n]), default=0.0)


def block_size(history: Sequence[float], remaining: int, initial: int, lo: int, hi: int, adaptive: bool = True) -> int:
    """``lo + int((hi - lo) * mean(history[-2:]))`` clamped to ``[lo, hi]`` and to what remains."""
    if not adaptive:
        return min(initial, remaining)
    b = lo + int((hi - lo) * f32_mean(history[-2:])) if history else initial
    return min(max(lo, min(b, hi)), remaining)


def step_budget(history: Sequence[float], size: int, initial_steps: int, max_steps: int, initial_size: int,
                adaptive: bool = True) -> int:
    """More steps when confidence is low, scaled by ``size / initial_size`` (unscaled while ``history`` is empty)."""
    if not (history and adaptive):
        return initial_steps
    conf = max(0.0, min(1.0, f32_mean(history[-2:])))
    s = initial_steps + int((max_steps - initial_steps) * (1.0 - conf))
    s = max(initial_steps, min(s, max_steps))
    return max(1, int(s * size / initial_size))


def vocab_size(progress: float, history: Sequence[float], recent: Sequence[int], initial: int, lo: int, hi: int,
               adaptive: bool = True, repetition: bool = True) -> int:
    """``V_t``: by phase of the generation, scaled up when confidence is low or falling or tokens repeat."""
    if not adaptive:
        return int(np.clip(initial, lo, hi))
    v = hi * 0.8 if progress < 0.2 else (initial * 0.7 if progress < 0.7 else initial * 0.9)
    if history:
        r = float(np.mean(history[-5:]))
        f = 1.5 if r < 0.3 else 1.2 if r < 0.6 else 0.8 if r > 0.8 else 1.0
        if (history[-1] - history[-3] if len(history) >= 3 else 0) < -0.1:
            f *= 1.3
        v *= f
    rep = repetition_score(recent) if repetition else 0.0
    if rep > 0.5:
        v *= 1.0 + rep * 2.0
    return int(np.clip(v, lo, hi))


def linear_threshold(i: int, steps: int, start: float = 0.85, end: float = 0.4) -> float:
    """Relaxes linearly from ``start`` at step 0 to ``end`` at step ``steps`` (and stays there)."""
    q = i / max(steps, 1)
    return max(start * (1 - q) + end * q, end)
