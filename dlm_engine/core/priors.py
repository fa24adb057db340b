"""Confidence and score transforms shared by strategies (docs/specs/d2cache.md §4.1, §4.6, §5).

* :func:`certainty_density`: the certainty prior. A position near many decoded positions scores higher:
  ``score = confidence * density(decoded, sigma)``.
* :func:`debias` with a :class:`FrequencyTable`: PC-Sampler's debiasing. A confident proposal of a token that
  is frequent in a reference corpus is worth less: ``min(-confidence * ln(freq[x0] + 1e-10), alpha)``.
"""
from __future__ import annotations

import functools
import json
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


def debias(confidence: torch.Tensor, x0: torch.Tensor, freq: torch.Tensor, alpha: Optional[float]) -> torch.Tensor:
    """PC-Sampler: ``min(-confidence * ln(freq[x0] + 1e-10), alpha)`` (``alpha`` None -> 10), in the
    confidence's dtype."""
    a = 10.0 if alpha is None else float(alpha)
    f = freq.to(device=confidence.device, dtype=confidence.dtype)[x0]
    return torch.clamp(-confidence * torch.log(f + 1e-10), max=a)

