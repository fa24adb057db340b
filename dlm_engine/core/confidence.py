"""The range of values a strategy's confidences take, to validate the thresholds compared with them
(docs/thresholds.md).

A threshold is only meaningful inside the range of the confidence it is compared with: above the largest value
no position ever passes (the rule silently falls back to its minimum rate), at or below the smallest every
candidate does. Which range applies depends on the confidence *kind* in use -- a probability, a top-1 minus
top-2 margin, a uniform draw, a (negative) entropy, or PC-Sampler's debiased score ``-p ln(freq)``, which is
clipped at ``clip_alpha`` and so exceeds 1 (docs/specs/d2cache.md §4, §4.1). :func:`sampler_confidence` tells
the kind of :func:`dlm_engine.core.sampler.sample_tokens`' confidences from its options;
:meth:`ConfidenceKind.check` validates one option against it.

A certainty prior (``sigma``) multiplies the confidences by a density in ``[0, 1]`` (§5): it moves scores towards
0 but never past a bound of the kind, so the ranges below hold for the scores too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from dlm_engine.errors import ConfigError


class Confidence(str, Enum):
    """The one enum of confidence kinds (docs/glossary.md, "Confidence kinds"): how a step ranks its
    candidates, higher = commit sooner. Every strategy option that picks a kind has this type (LLaDA's
    ``confidence``, the d2c family's and WINO's ``alg``, CadLLM's ``confidence_method``); the names the
    references use are aliases of the same members, so ``alg=maskgit_plus`` is ``prob`` and
    ``confidence_method=softmax`` is ``prob`` too.

    A kind fixes the ranking, not one formula: the ``entropy`` kind ranks by low entropy ``H``, and each
    reference's own monotone form of it is kept for parity (LLaDA-style strategies ``exp(-H)``, the d2c family
    and Dream ``-H``, CadLLM ``1 / (1 + H)`` over its top-V logits, the sampler's ``inv_entropy``)."""

    prob = "prob"                   # probability of the proposal x0 under the clean softmax
    margin = "margin"               # top-1 minus top-2 probability
    entropy = "entropy"             # low entropy first (the strategy's reference form, see above)
    inv_entropy = "inv_entropy"     # 1 / (1 + H) over the top-V logits (CadLLM's entropy)
    random = "random"               # uniform noise
    # the references' names (aliases: the same members)
    maskgit_plus = "prob"           # Dream / d2Cache / WINO alg
    topk_margin = "margin"          # Dream / d2Cache / WINO alg
    softmax = "prob"                # CadLLM confidence_method

    @classmethod
    def _missing_(cls, value):
        """``Confidence("maskgit_plus")``: a reference's name looked up as an alias."""
        return cls.__members__.get(value) if isinstance(value, str) else None

    @classmethod
    def kinds(cls):
        """The canonical names, without the aliases."""
        return tuple(m.value for m in cls)


class Remasking(str, Enum):
    """How the candidates of a step are ranked (LLaDA's ``remasking`` option): by a confidence, or by uniform
    noise (``random``). It re-masks nothing (that is ``FrameDelta.remask``)."""

    low_confidence = "low_confidence"
    random = "random"


def check_kind(key: str, value: Any, allowed) -> None:
    """A :class:`ConfigError` naming ``strategy.<key>`` unless the confidence kind ``value`` is one a strategy
    implements (``allowed``: the kinds, in the order the message lists them)."""
    if Confidence(value) not in allowed:
        names = " | ".join(Confidence(a).name for a in allowed)
        raise ConfigError(f"strategy.{key}={Confidence(value).value} is not a kind this strategy ranks by "
                          f"(choose {names})")


def ranking(remasking: Any, confidence: Any = Confidence.prob) -> Confidence:
    """The one remasking -> confidence mapping: ``remasking=random`` ranks by noise, ``low_confidence`` by the
    confidence kind ``confidence`` (LLaDA's ``confidence`` option; ``prob`` for the strategies without one)."""
    if Remasking(remasking) == Remasking.random:
        return Confidence.random
    return Confidence(confidence)

CLIP_ALPHA = 10.0     # PC-Sampler's clip when ``clip_alpha`` is not given


def _num(x: float) -> str:
    return "inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:g}"


@dataclass(frozen=True)
class ConfidenceKind:
    """Confidences that lie in ``[low, high]`` (``[low, high)`` when ``high_reached`` is False).

    A threshold ``t`` compared as ``confidence >= t`` must satisfy ``low < t <= high`` (``t < high`` when
    ``high_reached`` is False): at or below ``low`` every candidate passes, above ``high`` none ever does.
    ``what`` names the kind and the options that chose it, for error messages."""

    what: str
    low: float
    high: float
    high_reached: bool = True
    passes_all: str = "every candidate would pass it"      # what a threshold at or below ``low`` means
    low_admitted: bool = False      # a rule whose threshold at ``low`` is a meaningful setting (early exit at once)

    @property
    def interval(self) -> str:
        """The thresholds this kind admits, as an interval."""
        closed = self.high_reached and not math.isinf(self.high)
        return f"{'[' if self.low_admitted else '('}{_num(self.low)}, {_num(self.high)}{']' if closed else ')'}"

    def check(self, key: str, value: Any, allow_none: bool = False) -> None:
        """Raise :class:`ConfigError` (naming ``strategy.<key>``) unless ``value`` is a threshold this kind can
        both reach and fail."""
        if value is None:
            if allow_none:
                return
            raise ConfigError(f"strategy.{key} must be set")
        try:
            t = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"strategy.{key}={value!r} is not a number") from None
        if math.isnan(t) or math.isinf(t):
            raise ConfigError(f"strategy.{key}={value} must be a finite number in {self.interval} for {self.what}")
        if t > self.high or (t == self.high and not self.high_reached):
            bound = "never exceed" if self.high_reached else "stay below"
            raise ConfigError(f"strategy.{key}={value} is impossible for {self.what}, which {bound} "
                              f"{_num(self.high)}: no position would ever pass it; use a value in {self.interval}")
        if t < self.low or (t == self.low and not self.low_admitted):
            raise ConfigError(f"strategy.{key}={value} is outside {self.interval} for {self.what}: {self.passes_all}")


PROBABILITY = ConfidenceKind("probability confidences", 0.0, 1.0)


def sampler_confidence(alg: str = "prob", debias: bool = False, clip_alpha: Optional[float] = None,
                       debias_after_alg: bool = False, prefix: str = "strategy.") -> ConfidenceKind:
    """The kind of the confidences :func:`~dlm_engine.core.sampler.sample_tokens` returns with these options:
    ``alg`` replaces the (debiased) probability -- by a margin in ``[0, 1]``, an entropy ``sum p ln p`` in
    ``[-ln V, 0]`` or a uniform draw in ``[0, 1)`` -- and debias (``debias``, with the corpus weights
    ``-ln(freq) >= 0``) multiplies what it applies to and clips it at ``clip_alpha`` (null: 10): the probability
    for ``maskgit_plus`` (the other algs overwrite it, the reference's quirk), or the alg's value with
    ``debias_after_alg``."""
    alg = Confidence(alg)
    base = {Confidence.prob: PROBABILITY,
            Confidence.margin: ConfidenceKind("top-1 minus top-2 probability margins", 0.0, 1.0),
            Confidence.random: ConfidenceKind("uniform random confidences", 0.0, 1.0, high_reached=False),
            Confidence.entropy: ConfidenceKind("entropy confidences sum p ln p", -math.inf, 0.0)}[alg]
    alg = alg.value
    where = f"{prefix}alg={alg}"
    if not debias:
        return ConfidenceKind(f"{base.what} ({where})", base.low, base.high, base.high_reached)
    if alg != Confidence.prob and not debias_after_alg:
        return ConfidenceKind(f"{base.what} ({where}, which replaces PC-Sampler's debiased value unless "
                              f"{prefix}debias_after_alg=true)", base.low, base.high, base.high_reached)
    if alg == "entropy":        # a non-positive value times a non-negative weight stays <= 0 (the clip never acts)
        return ConfidenceKind(f"debiased entropy confidences ({where}, {prefix}debias=true)", -math.inf, 0.0)
    a = CLIP_ALPHA if clip_alpha is None else float(clip_alpha)
    return ConfidenceKind(f"PC-Sampler's debiased confidences ({where}, {prefix}debias=true, clipped at "
                          f"{prefix}clip_alpha={_num(a)})", 0.0, a)
