"""The shared sampler: proposal token and confidence for every queried position.

Gumbel-max at ``T > 0`` follows the references exactly: logits in float64, one draw of
``torch.rand`` over the full shape of the model call ``(B, call_len, V)`` from the global RNG, score
``exp(l) / (-log u)^T``. The window the strategy asked for is a slice of that draw, so the random
stream matches the references even when only part of the logits is materialised.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dlm_engine.core.fast.row_max import row_max
from dlm_engine.core.confidence import Confidence

CONFIDENCE_KINDS = Confidence.kinds()    # the kinds a StepPlan may ask for (docs/glossary.md)

# logits a confidence pass must leave out for computing it at chosen positions only (StepPlan.masked, the d2c
# family's block candidates) to pay off: below this the gathering costs more than it saves (~20 us on a CPU)
SCORED_MIN_SAVING = 1 << 16
# ... counted in softmax elements. CadLLM's top-V pick costs far more per logit left out on a CPU ([32, 4,096]
# float32 logits, one thread: a softmax 0.6 ns a logit, float64 ~2, the top-V pick 9-20), so it pays for the
# gathering at fewer positions (measured on d256: its sample time a step -15%; the float64 softmax's ~3x gained
# nothing measurable and keeps the plain count). On a GPU every pass is a few launches whatever its width: the
# plain count stands there
SCORED_WEIGHT_TOP_V = 8
# confidence kinds computed per position without a sum over the vocabulary (softmax, top-k, gather): the same
# bits for any number of positions. A sum (entropy) may split differently for few rows (CPU two-pass reduction
# over one row with several threads, GPU reduction shapes), so those are always computed over the whole window
ROW_EXACT_KINDS = ("prob", "margin")


@dataclass
class Proposal:
    """Proposal for the window ``[start, start + W)``."""

    start: int
    x0: torch.Tensor           # [B, W] argmax of the (noised) logits
    confidence: torch.Tensor   # [B, W] float
    logits: torch.Tensor       # [B, W, V] clean logits (after CFG / EOS edits), model dtype
    call_len: Optional[int] = None    # columns of the model call the window came from (RNG draw shape)
    call_start: Optional[int] = None  # first canvas column of that call
    valid: Optional[torch.Tensor] = None   # [B, W] bool: logits the call computed (None = all); others never rank
    rows: Optional[torch.Tensor] = None    # plans that sample themselves: the canvas rows the logits belong to
    aux_logits: Optional[torch.Tensor] = None   # plans with auxiliary columns: their logits [B_call, W_aux, V]
    active: Optional[torch.Tensor] = None       # [B] bool: the rows that took part in the call (set by the loop)
    pads: Tuple[int, ...] = ()                  # per row: left-padding columns of the canvas (set by the loop)
    # set by the loop: something downstream (a cache's ``after_step``, ``Cache.reads_confidence``) reads the
    # step's confidence at every window position, so none may be left out (StepPlan.masked is then ignored)
    all_confidences: bool = False
    # [B, W] bool: the window's masked positions, when the loop compared them for the sampler (``StepPlan.masked``):
    # a fresh tensor that :func:`dlm_engine.core.strategy.candidates` takes over instead of comparing again
    masked: Optional[torch.Tensor] = None
    # the confidences were computed at the window's masked positions only: every other position holds -inf
    masked_confidence: bool = False

    @property
    def row_span(self):
        """``(offset, width)`` of the window inside the model call's columns: the row the references rank
        candidates in (``torch.topk`` breaks exact ties by the row's length), or None when unknown. In a padded
        batch a third element gives each row's padding columns inside that row: a row is ranked as it would
        be in a batch of one, so exact ties do not depend on the batch."""
        if self.call_len is None or self.call_start is None:
            return None
        lead = tuple(max(0, p - self.call_start) for p in self.pads)
        if any(lead):
            return self.start - self.call_start, self.call_len, lead
        return self.start - self.call_start, self.call_len


def suppress_(logits: torch.Tensor, ids) -> torch.Tensor:
    """``logits[..., i] = -inf`` for every token id ``i`` of ``ids``, in place: one column at a time (an index list
    would be a host-to-device copy)."""
    for i in ids:
        logits[..., i] = float("-inf")
    return logits


def noise_draw(shape, device) -> torch.Tensor:
    return torch.rand(shape, dtype=torch.float64, device=device)


def gumbel_argmax(logits: torch.Tensor, temperature: float, call_len: int, offset: int) -> torch.Tensor:
    """argmax of Gumbel-noised logits; at T == 0 plain argmax and no RNG use."""
    if temperature == 0:
        return row_max(logits, values=False)
    B, W, V = logits.shape
    u = noise_draw((B, call_len, V), logits.device)[:, offset:offset + W]
    l64 = logits.to(torch.float64)
    gumbel = (-torch.log(u)) ** temperature
    return row_max(l64.exp() / gumbel, values=False)


def scoring_pays_off(left_out: int, V: int, top_v: Optional[int], device: torch.device) -> bool:
    """Whether computing a ``prob``/``margin`` confidence at chosen positions only (``left_out`` positions of a
    vocabulary of ``V`` skipped) saves more than gathering those positions costs (``SCORED_MIN_SAVING``)."""
    weight = SCORED_WEIGHT_TOP_V if top_v is not None and device.type == "cpu" else 1
    return left_out * V * weight >= SCORED_MIN_SAVING


def softmax_in(logits: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype == "float64":       # (cast first, then the softmax: one call)
        return torch.softmax(logits, dim=-1, dtype=torch.float64)
    return torch.softmax(logits, dim=-1)


def entropy_floor(dtype: torch.dtype) -> float:
    """The floor of the probabilities whose log the ``entropy`` confidence takes: 1e-30, or the dtype's smallest
    positive number where 1e-30 is 0 (float16: 2^-24). A probability that underflowed to 0 then adds ``0 * log
    floor = 0`` to the entropy; with a floor of 0 it adds ``0 * -inf = NaN`` (every float16 softmax over a large
    vocabulary has such zeros, so its entropies were all NaN)."""
    fi = torch.finfo(dtype)
    return max(1e-30, fi.tiny * fi.eps)


def confidence_of(logits: torch.Tensor, x0: torch.Tensor, kind: str, dtype: str = "model",
                  call_len: Optional[int] = None, offset: int = 0, top_v: Optional[int] = None,
                  x0_is_argmax: bool = False) -> torch.Tensor:
    """Confidence of the proposal ``x0``.

    * ``prob``: clean probability of ``x0`` (softmax in model dtype or float64). With ``top_v`` the
      softmax runs over the top-``top_v`` logits only (float64) and a proposal outside them gets 0.
    * ``margin``: top-1 minus top-2 clean probability.
    * ``entropy``: ``exp(-H)`` of the clean distribution (1 = certain), ``H = -sum p log max(p, floor)`` with
      :func:`entropy_floor`'s floor.
    * ``inv_entropy``: CadLLM's ``1 / (1 + H)`` with ``H = -sum p log(p + 1e-12)`` over the softmax (model
      dtype) of the top-``top_v`` logits (all logits when ``top_v`` is None); independent of ``x0``.
    * ``random``: ``torch.rand((B, call_len))`` float32, sliced to the window (LLaDA's random remasking).

    ``x0_is_argmax``: ``x0`` is ``logits.argmax(-1)``, so its ``prob`` is the softmax's maximum, read with one
    reduction instead of a gather (the same element: the largest logit's exponent is ``exp(0) = 1``, every other
    one at most that, and the softmax scales them all by the same sum).
    """
    if top_v is not None:
        top_v = min(int(top_v), logits.shape[-1])   # a vocabulary smaller than the requested top-V
    if kind == "random":
        B, W = x0.shape
        n = call_len if call_len is not None else W
        return torch.rand((B, n), device=x0.device)[:, offset:offset + W]
    if kind == "prob":
        if top_v is not None:
            vals, idx = torch.topk(logits, top_v, dim=-1)
            p = torch.softmax(vals, dim=-1, dtype=torch.float64)     # (casts first: one op, the same bits)
            hit = idx == x0[..., None]
            return torch.where(hit, p, 0.0).sum(-1)
        if x0_is_argmax:
            return softmax_in(logits, dtype).amax(-1)
        return torch.gather(softmax_in(logits, dtype), -1, x0[..., None]).squeeze(-1)
    if kind == "inv_entropy":
        vals = logits if top_v is None else torch.topk(logits, top_v, dim=-1).values
        p = softmax_in(vals, dtype)
        h = -(p * torch.log(p + 1e-12)).sum(-1)
        return 1.0 / (1.0 + h)
    if kind == "margin":
        p = softmax_in(logits, dtype)
        top2 = torch.topk(p, 2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if kind == "entropy":
        p = softmax_in(logits, dtype)
        h = -(p * torch.log(p.clamp_min(entropy_floor(p.dtype)))).sum(-1)
        return torch.exp(-h)
    raise ValueError(f"unknown confidence kind '{kind}' (choose from {', '.join(CONFIDENCE_KINDS)})")


def propose(logits: torch.Tensor, start: int, *, temperature: float, confidence: str, softmax_dtype: str = "model",
            call_len: Optional[int] = None, call_start: Optional[int] = None, top_v: Optional[int] = None,
            discard_draws: int = 0, valid: Optional[torch.Tensor] = None,
            scored: Optional[Tuple[torch.Tensor, int]] = None) -> Proposal:
    """Sample proposals for a window of logits ``[B, W, V]`` starting at canvas column ``start``.

    ``call_len``/``call_start`` describe the model call the logits came from (for the RNG shape);
    ``discard_draws`` extra noise draws are made first and thrown away (Fast-dLLM prefix-cache quirk).
    ``valid`` marks the columns whose logits the call computed: the others get confidence ``-inf`` and are
    never committed (their logits are zeros, not a distribution).
    ``scored = (mask [B, W], count, tokens [B, W])``: confidences are needed at the ``count`` positions of
    ``mask`` only (the candidates that can be committed): they are computed there, row by row exactly as over the
    whole window, and the other positions get ``-inf``. Not for ``random`` confidences (their draw has the
    window's shape). At ``T = 0`` (no draw) the proposals too are made there only (an argmax is per position) and
    the other positions propose the token they hold in the window's current ``tokens``.
    """
    B, W, V = logits.shape
    call_len = W if call_len is None else call_len
    offset = 0 if call_start is None else start - call_start
    if temperature > 0:
        for _ in range(discard_draws):
            noise_draw((B, call_len, V), logits.device)
    if scored is not None and confidence != "random":
        x0 = gumbel_argmax(logits, temperature, call_len, offset) if temperature > 0 else None
        x0, conf = scored_proposal(logits, x0, confidence, softmax_dtype, top_v, *scored)
    else:
        x0 = gumbel_argmax(logits, temperature, call_len, offset)
        conf = confidence_of(logits, x0, confidence, softmax_dtype, call_len, offset, top_v,
                             x0_is_argmax=temperature == 0)
    if valid is not None:
        conf = conf.masked_fill(~valid, float("-inf"))
    return Proposal(start=start, x0=x0, confidence=conf, logits=logits, call_len=call_len, call_start=start - offset,
                    valid=valid)


def scored_proposal(logits: torch.Tensor, x0: Optional[torch.Tensor], kind: str, dtype: str, top_v: Optional[int],
                    mask: torch.Tensor, count: int, tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x0, confidence)`` with :func:`confidence_of` computed at the ``count`` positions of ``mask`` only (a
    softmax is a per-position computation: the values the whole window gives there) and ``-inf`` elsewhere.
    ``x0``: the window's proposals (a draw has the window's shape), or None at ``T = 0``: the argmax is then taken
    at those positions only too, and the others propose the token ``tokens`` holds."""
    from dlm_engine.core.selection import masked_order

    B, W, V = logits.shape
    order = masked_order(mask, count)
    rows = logits.reshape(B * W, V).index_select(0, order)      # (a copy of the rows: faster than x[order])
    argmax = x0 is None
    if argmax:
        picked = row_max(rows, values=False)
        x0 = tokens.reshape(-1).to(torch.long, copy=True).index_copy_(0, order, picked).view(B, W)
    else:
        picked = x0.reshape(-1)[order]
    # (positions as one leading axis: every kind but random, which is never scored, works over the last axis alone)
    conf = confidence_of(rows, picked, kind, dtype, top_v=top_v, x0_is_argmax=argmax)
    return x0, placed(conf, order, (B, W), float("-inf"))


def placed(values: torch.Tensor, order: torch.Tensor, shape: Tuple[int, int], fill) -> torch.Tensor:
    """A ``shape`` tensor holding ``values`` at the flat positions ``order`` and ``fill`` elsewhere: results
    computed at chosen positions only, put back in place."""
    out = torch.full((shape[0] * shape[1],), fill, dtype=values.dtype, device=values.device)
    return out.index_copy_(0, order, values).view(shape)


# -- Dream-style proposals (docs/specs/dream.md §4.1 and §8): nucleus / top-k filters, categorical draws,
# -- position draws. Strategies that follow Dream's rules call these from ``select`` on clean logits.

def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter over the last axis: keep the smallest prefix of the sorted logits whose softmax mass
    reaches ``top_p`` (the token that crosses it is kept, the top token always); the rest is set to
    ``finfo(dtype).min`` (not ``-inf``), as Dream's ``top_p_logits`` does."""
    sorted_logits, order = torch.sort(logits, descending=True)
    mass = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = mass > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    drop = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, drop)
    return logits.masked_fill(drop, torch.finfo(logits.dtype).min)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep logits ``>=`` the row's k-th largest (ties at the k-th value survive); the rest -> ``finfo.min``."""
    k = min(int(top_k), logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def filtered_probs(logits: torch.Tensor, temperature: float, top_p: Optional[float] = None,
                   top_k: Optional[int] = None) -> torch.Tensor:
    """``softmax`` after temperature, top-p and top-k, in that order (in the logits' dtype)."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_filter(logits, top_p)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    return torch.softmax(logits, dim=-1)


def categorical_draw(probs: torch.Tensor) -> Optional[torch.Tensor]:
    """One id per row of ``probs [M, V]``, making exactly the RNG calls of
    ``torch.distributions.Categorical(probs=probs).sample()`` (renormalise, ``multinomial(·, 1, True)``).

    Returns None where ``Categorical`` would reject its argument (a row off the simplex by ``>= 1e-6``
    after renormalising, e.g. in bf16, or NaN): the references then fall back to argmax, no RNG used.
    """
    p = probs / probs.sum(-1, keepdim=True)
    if p.shape[0] and not bool(((p >= 0).all(-1) & ((p.sum(-1) - 1).abs() < 1e-6)).all()):
        return None
    return torch.multinomial(p, 1, True).squeeze(-1)


def draw_tokens(probs: torch.Tensor, temperature: float):
    """``(confidence, x0)``: a categorical draw at ``T > 0`` (confidence = ``probs[x0]``, not renormalised),
    else -- or when the draw is rejected -- ``max``/``argmax`` of ``probs``."""
    if temperature > 0:
        x0 = categorical_draw(probs)
        if x0 is not None:
            return torch.gather(probs, -1, x0[:, None]).squeeze(-1), x0
    conf, x0 = row_max(probs)
    return conf, x0


ALGS = (Confidence.prob, Confidence.margin, Confidence.entropy, Confidence.random)   # sample_tokens' kinds


@dataclass
class Sampled:
    """Result of :func:`sample_tokens`: per position the confidence, the token and the (filtered) distribution."""

    confidence: torch.Tensor   # [..., ] in the logits' dtype
    x0: torch.Tensor           # [..., ] long
    probs: Optional[torch.Tensor]   # [..., V] softmax after temperature and filters (None: not kept)


def sample_tokens(logits: torch.Tensor, temperature: float = 0.0, top_p: Optional[float] = None,
                  top_k: Optional[int] = None, alg: str = "prob", freq=None,
                  clip_alpha: Optional[float] = None, debias_after_alg: bool = False,
                  filters_at_zero: bool = True) -> Sampled:
    """Dream's and the d2Cache framework's per-position sampler over logits ``[..., V]`` (any leading shape;
    positions are drawn in row-major order, which fixes the RNG stream).

    Temperature, top-p and top-k reshape the distribution (also at temperature 0 unless ``filters_at_zero`` is
    False -- a reference quirk: they change confidences there); then a categorical draw at ``T > 0`` (one
    ``multinomial`` over all positions) or the argmax. ``freq`` (PC-Sampler, :func:`dlm_engine.core.priors.debias`:
    the frequencies or their ``FrequencyWeights``) rescales the confidence; ``alg`` then replaces it --
    ``margin`` (``topk_margin``): top-1 minus top-2 probability, ``entropy``: ``sum p ln(p + 1e-10)`` (higher = more certain),
    ``random``: uniform noise (one ``torch.rand`` after the draw) -- which overwrites the debiased value unless
    ``debias_after_alg``.
    """
    try:
        alg = Confidence(alg)      # a kind or a reference's name for it (maskgit_plus, topk_margin)
    except ValueError:
        alg = None
    if alg not in ALGS:
        raise ValueError(f"unknown alg (choose from {', '.join(a.value for a in ALGS)})")
    shape, V = logits.shape[:-1], logits.shape[-1]
    # the categorical draw takes rows; everything else works on any leading shape (no reshapes, four ops fewer)
    rows = temperature > 0 and logits.dim() != 2
    flat = logits.reshape(-1, V) if rows else logits
    use_filters = filters_at_zero or temperature > 0
    probs = filtered_probs(flat, temperature, top_p if use_filters else None, top_k if use_filters else None)
    conf, x0 = draw_tokens(probs, temperature)

    def debiased(c):
        from dlm_engine.core.priors import debias

        return debias(c, x0, freq, clip_alpha)

    if freq is not None and not debias_after_alg:
        conf = debiased(conf)
    if alg == Confidence.margin:
        top2 = torch.topk(probs, 2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    elif alg == Confidence.entropy:
        conf = (probs * torch.log(probs + 1e-10)).sum(-1)
    elif alg == Confidence.random:
        conf = torch.rand_like(conf)
    if freq is not None and debias_after_alg:
        conf = debiased(conf)
    if not rows:
        return Sampled(conf, x0, probs)
    return Sampled(conf.reshape(shape), x0.reshape(shape), probs.reshape(shape + (V,)))


def sample_positions(scores: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """``k`` column indices per row drawn without replacement from ``softmax(scores / temperature)``
    (``-inf`` scores are never drawn): Dream's ``alg_temp`` position sampling."""
    return torch.multinomial(torch.softmax(scores / temperature, dim=-1), num_samples=int(k))
