"""Confidence and score transforms shared by strategies (docs/specs/d2cache.md §4.1, §4.6, §5).

* :func:`certainty_density`: the certainty prior. A position near many decoded positions scores higher:
  ``score = confidence * density(decoded, sigma)``.
* :func:`debias` with a :class:`FrequencyTable`: PC-Sampler's debiasing. A confident proposal of a token that
  is frequent in a reference corpus is worth less: ``min(-confidence * ln(freq[x0] + 1e-10), alpha)``.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Optional

import torch

from dlm_engine.errors import UserError

BUNDLED_TABLES = ("llada", "dream")


@functools.lru_cache(maxsize=16)
def _kernel(L: int, sigma: float, device: str) -> torch.Tensor:
    """``[3L, L]`` Gaussian weights ``g(L + i - j) / K`` in float64 (``K`` = the sum of ``g`` over ``[-3L, 3L)``)."""
    d = torch.arange(-3 * L, 3 * L, dtype=torch.float64)
    # d^2 is an integer; the reference divides it by 2 sigma^2 in float32 before exp
    denom = torch.tensor(2 * sigma * sigma, dtype=torch.float32)
    g = torch.exp(-((d * d).to(torch.float32) / denom).to(torch.float64))
    K = g.sum()
    j = torch.arange(3 * L)[:, None]
    i = torch.arange(L)[None, :]
    return (g[(L + i - j) + 3 * L] / K).to(device)


def certainty_density(decoded: torch.Tensor, sigma: float) -> torch.Tensor:
    """Density of decoded positions around every position of ``decoded`` (``[B, L]`` bool, True = decoded).

    The row is extended to ``[L ones | decoded | L copies of its last entry]`` and convolved with a Gaussian
    of width ``sigma``, normalised by the kernel's total mass (a constant, not a local normaliser): positions
    deep inside decoded text get ~1, isolated masked positions less. Computed in float64 and returned in
    float32; the reference's float32 FFT differs by ~1e-7 relative.
    """
    B, L = decoded.shape
    x = decoded.to(torch.float64)
    ext = torch.cat([torch.ones((B, L), dtype=torch.float64, device=x.device), x,
                     x[:, -1:].expand(B, L)], dim=1)
    return (ext @ _kernel(L, float(sigma), str(x.device))).to(torch.float32)


@functools.lru_cache(maxsize=64)
def density_floor(L: int, sigma: float) -> float:
    """A lower bound of every density of length ``L`` (host arithmetic, no tensor): the extended row's leading ones
    reach position ``i`` at distance ``i + 1 <= L``, so each density is at least ``g(L) / K``; the computed one too
    (its terms are ``1.0 * K[j, i] >= 0``, and a sum of non-negative terms never rounds below one of them). Far
    from decoded text with a narrow ``sigma`` this underflows to 0 (then ``0 * -inf`` would be NaN)."""
    g = [math.exp(-(d * d) / (2.0 * sigma * sigma)) for d in range(-3 * L, 3 * L)]
    return g[L + 3 * L] / sum(g)


class CertaintyDensity:
    """:func:`certainty_density` for a decode's every step, with its extended rows kept between calls.

    The ``[B, 3L]`` float64 rows start as ones; a call writes the decoded flags (``~masked``, converted by the
    write itself) into the middle third and repeats the last one across the final third, then multiplies by the
    cached kernel: the same rows and the same product as :func:`certainty_density`, in 4 tensor operations
    instead of 9 (no negation, no float64 copy, no concatenation). One object per decode (its buffer is
    overwritten by every call); a call with another shape or device makes a new buffer.

    ``positive`` (after a call, for its length): every density of that length is a positive float32, so a score
    ``confidence * density`` is ``-inf`` exactly where the confidence is (see :func:`density_floor`).
    """

    __slots__ = ("sigma", "positive", "_key", "_buf", "_mid", "_tail", "_last", "_kernel")

    def __init__(self, sigma: float):
        self.sigma = float(sigma)
        self.positive = False
        self._key = None

    def of_masked(self, masked: torch.Tensor) -> torch.Tensor:
        """``certainty_density(~masked, sigma)`` (``masked``: ``[B, L]`` bool, True = still masked)."""
        B, L = masked.shape
        key = (B, L, masked.device)
        if key != self._key:
            buf = torch.ones((B, 3 * L), dtype=torch.float64, device=masked.device)
            self._buf, self._mid, self._tail = buf, buf[:, L:2 * L], buf[:, 2 * L:]
            self._last = self._mid[:, -1:]
            self._kernel = _kernel(L, self.sigma, str(masked.device))
            self.positive = density_floor(L, self.sigma) > 1e-30
            self._key = key
        torch.logical_not(masked, out=self._mid)
        self._tail.copy_(self._last)
        return (self._buf @ self._kernel).to(torch.float32)


class FrequencyTable:
    """Corpus token frequencies for PC-Sampler, as a length-``V`` float32 vector.

    Every id starts at ``1 / num_token``; ids with a corpus count ``c`` get ``c / num_token`` (divided in
    Python double, then cast). Ids ``>= V`` are dropped (a table for a larger tokenizer on a smaller model).
    """

    @staticmethod
    def bundled_path(name: str) -> Path:
        return Path(__file__).resolve().parents[1] / "data" / "pc_sampler" / f"{name}_corpus.json"

    @classmethod
    def resolve(cls, spec: str, model_type: Optional[str]) -> Path:
        """The table file for ``spec``: ``auto`` (by model family), a bundled name, or a path."""
        if spec == "auto":
            family = (model_type or "").lower()
            if family not in BUNDLED_TABLES:
                raise UserError(f"strategy.freq_table=auto: no bundled PC-Sampler table for model_type "
                                f"'{model_type}' (set strategy.freq_table to llada, dream or a JSON file)")
            spec = family
        if spec in BUNDLED_TABLES:
            return cls.bundled_path(spec)
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"strategy.freq_table: '{spec}' is neither llada, dream nor an existing JSON file")
        return path

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def load(path: str, vocab: int) -> torch.Tensor:
        try:
            data = json.loads(Path(path).read_text())
            n = int(data["num_token"])
            counts = data.get("p_baseline_dict", data.get("counts"))
            if not isinstance(counts, dict) or n <= 0:
                raise ValueError("expected num_token > 0 and a p_baseline_dict of counts")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"strategy.freq_table: cannot read '{path}' ({exc})") from None
        freq = [1.0 / n] * vocab
        for tid, c in counts.items():
            i = int(tid)
            if 0 <= i < vocab:
                freq[i] = float(c) / n
        return torch.tensor(freq, dtype=torch.float32)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def weights(path: str, vocab: int) -> "FrequencyWeights":
        """The table's :class:`FrequencyWeights` (shared by every decode of the process)."""
        return FrequencyWeights(FrequencyTable.load(path, vocab))


class FrequencyWeights:
    """PC-Sampler's per-token weights ``-ln(freq + 1e-10)`` over the whole vocabulary, made once per dtype and
    device (the frequencies cast to that dtype first, as the reference casts them to the confidence's).

    A step then gathers the weights of its proposals (one op) instead of gathering, casting, adding and taking
    the log there (four): the same values, since the cast is exact and the log is computed per element
    (``tests/test_loop_ops.py`` checks both forms bit for bit).
    """

    __slots__ = ("freq", "_made")

    def __init__(self, freq: torch.Tensor):
        self.freq = freq
        self._made = {}

    def at(self, x0: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, x0.device)
        w = self._made.get(key)
        if w is None:
            w = self._made[key] = torch.log(self.freq.to(device=x0.device, dtype=dtype) + 1e-10).neg_()
        return w[x0]


def debias(confidence: torch.Tensor, x0: torch.Tensor, freq, alpha: Optional[float]) -> torch.Tensor:
    """PC-Sampler: ``min(-confidence * ln(freq[x0] + 1e-10), alpha)`` (``alpha`` None -> 10), in the
    confidence's dtype. ``freq``: the frequencies' :class:`FrequencyWeights` (or the frequencies themselves, whose
    weights are then made for this call). ``-c * l`` and ``c * -l`` are the same float."""
    a = 10.0 if alpha is None else float(alpha)
    w = freq if isinstance(freq, FrequencyWeights) else FrequencyWeights(freq)
    return (confidence * w.at(x0, confidence.dtype)).clamp_(max=a)

