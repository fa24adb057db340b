"""Selection rules shared by strategies: transfer schedules, top-k, threshold and factor commits.

All functions are batched: ``conf`` is ``[B, W]`` with ``-inf`` (or any value) outside ``cand``.
"""
from __future__ import annotations

import functools
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dlm_engine.core.devices import host_tensor

NEG_INF = float("-inf")


def transfer_schedule(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """Front-loaded schedule ``[B, steps]``: ``n // S`` per step, the remainder's +1s on the first steps."""
    n = mask_count.to(torch.int64)
    base = torch.div(n, steps, rounding_mode="floor")
    rem = n % steps
    idx = torch.arange(steps, device=n.device)
    return base[:, None] + (idx[None, :] < rem[:, None]).to(torch.int64)


def host_schedule(masked: Sequence[int], steps: int) -> Tuple[Tuple[int, ...], ...]:
    """:func:`dlm_engine.core.selection.transfer_schedule` on host numbers: ``n // steps`` per step, the
    remainder's +1s on the first steps."""
    return tuple(tuple(n // steps + (i < n % steps) for i in range(steps)) for n in masked)


def f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest even): what a float32 tensor holds for it, e.g. a Python threshold it is
    compared with, so that host decisions reproduce device ones."""
    return struct.unpack("f", struct.pack("f", x))[0]


def first_true(mask: torch.Tensor, default: int) -> torch.Tensor:
    """Per row of ``mask`` (``[..., N]`` bool) the index of its first True, ``default`` where there is none."""
    return torch.where(mask.any(-1), mask.int().argmax(-1), default)


def masked_conf(conf: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    return torch.where(cand, conf, NEG_INF)        # one kernel (masked_fill(~cand) is two)


def ranked_row(conf: torch.Tensor, cand: torch.Tensor, span: Optional[Tuple]) -> Tuple[torch.Tensor, int]:
    """``(row, offset)``: the candidates' scores (``-inf`` elsewhere) placed at ``offset`` of a ``-inf`` row of
    ``width`` (``span = (offset, width[, lead])``): the row a reference ranks in, so that exactly tied scores
    break the way its ``torch.topk`` breaks them (``topk`` on equal values depends on the row's length and on
    ``k``). ``lead`` (per row, on the host): the row's first columns that are left padding of a batch; each row
    is ranked without them, as in a batch of one (see :func:`row_lead`)."""
    row = masked_conf(conf, cand)
    if span is None or (span[0] == 0 and span[1] == conf.shape[1]):
        return row, 0
    off, width = span[0], span[1]
    return torch.nn.functional.pad(row, (off, width - off - conf.shape[1]), value=NEG_INF), off


def topk_commit(conf: torch.Tensor, cand: torch.Tensor, k, span: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Commit the ``k[b]`` most confident candidates of each row (never a non-candidate). With ``k`` a host
    sequence of ints they are chosen as ``torch.topk(row, k[b])`` chooses them in the reference's row (``span``,
    see :func:`ranked_row`); with a device tensor (a data-dependent count) by a stable sort, without a host read
    (exact ties then break towards the lower position)."""
    row, off = ranked_row(conf, cand, span)
    return topk_rows(row, k, lead=row_lead(span), cols=(off, off + conf.shape[1])) & cand


def row_lead(span: Optional[Tuple]) -> Optional[Sequence[int]]:
    """The per-row padding columns of a ranking row (``span[2]``), or None when no row has any."""
    return span[2] if span is not None and len(span) > 2 else None


def top1(conf: torch.Tensor, cand: torch.Tensor, span: Optional[Tuple[int, int]] = None,
         counts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The most confident candidate of every row that has one: the first of ``torch.topk(row, |cand|)`` (the
    Fast-dLLM reference's ``order[0]``; among exact ties that is not always the lowest index). ``counts``: the
    candidates per row, known on the host; without them the argmax (first index) is taken, with no host read."""
    return _top1_columns(conf, cand, span, counts) & cand


def _top1_columns(conf: torch.Tensor, cand: torch.Tensor, span: Optional[Tuple[int, int]] = None,
                  counts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """:func:`top1` before its ``& cand`` (a row whose candidates all score ``-inf`` may pick another column): for
    callers that intersect with ``cand`` anyway."""
    W = conf.shape[1]
    row, off = ranked_row(conf, cand, span)
    # the window's columns (as row positions) that are each row's pick: one comparison, not a scattered full row
    # that is then cut to the window
    if counts is None:
        return column_range(off, off + W, row.device) == row.argmax(-1, keepdim=True)
    lead = row_lead(span)
    if lead is None and all(m == counts[0] for m in counts):     # one call for every row
        if counts[0] <= 0:
            return torch.zeros_like(cand)
        return column_range(off, off + W, row.device) == torch.topk(row, int(counts[0]), dim=-1).indices[:, :1]
    commit = torch.zeros_like(row, dtype=torch.bool)
    for (m, a), rows in _groups(_keys(counts, lead), row.device):
        if m <= 0:
            continue
        first = torch.topk(row[rows, a:], int(m), dim=-1).indices[:, :1] + a
        commit[rows] = commit[rows].scatter(1, first, True)
    return commit[:, off:off + W]


def _keys(values: Sequence[int], lead: Optional[Sequence[int]]) -> List[Tuple[int, int]]:
    return [(int(v), 0 if lead is None else int(a)) for v, a in zip(values, lead or [0] * len(values))]


def _groups(values: Sequence, device) -> List[Tuple[object, torch.Tensor]]:
    """Rows grouped by a host value: ``[(value, row index tensor)]`` (one group when every row agrees)."""
    out: Dict[object, List[int]] = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    if len(out) == 1:
        v = next(iter(out))
        return [(v, slice(None))]
    return [(v, host_tensor(rs, torch.long, device)) for v, rs in out.items()]


def threshold_commit(conf: torch.Tensor, cand: torch.Tensor, tau, span: Optional[Tuple[int, int]] = None,
                     counts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Fast-dLLM: the top-1 candidate always, plus every candidate with ``conf >= tau`` (ties commit).

    ``tau`` is a float or a per-row tensor ``[B]``; ``counts``: candidates per row on the host (see :func:`top1`).
    """
    if not torch.is_tensor(tau):
        above = conf >= tau
    else:
        above = conf >= tau.to(conf.dtype)[:, None]
    return above.logical_or_(_top1_columns(conf, cand, span, counts)).logical_and_(cand)   # (one & for both)


def factor_commit(conf: torch.Tensor, cand: torch.Tensor, factor: float,
                  span: Optional[Tuple[int, int]] = None, counts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Fast-dLLM factor rule: the longest ranking prefix with ``c_(n) >= 1 - f/(n+1)`` for ranks n >= 2.

    Reproduces the reference's off-by-one: when the first failing rank is the last candidate, every
    candidate is committed. The ranking is the stable descending sort of the reference's row (``span``, see
    :func:`ranked_row`; exact ties break towards the lower position, as :func:`topk_commit` with a device count
    picks): one sort gives both the sorted scores and the order, and rank ``j`` is committed iff no rank up to
    ``j`` fails, the last candidate's rank exempt (the same set as the reference's top ``k``, ``k`` the first
    failing rank or every candidate; a rank past the candidates holds ``-inf`` and fails). ``counts``: the
    candidates per row, known on the host; when every row has the same number the exempt rank is in the cached
    thresholds, otherwise it is found on the device.
    """
    W = conf.shape[1]
    row, off = ranked_row(conf, cand, span)
    scores, order = torch.sort(row, dim=-1, descending=True, stable=True)
    if counts is not None and all(m == counts[0] for m in counts):
        _, thresh = _factor_thresholds(row.shape[1], float(factor), conf.dtype, conf.device, int(counts[0]) - 1)
        fails = scores < thresh
    else:
        ranks, thresh = _factor_thresholds(row.shape[1], float(factor), conf.dtype, conf.device)
        fails = (scores < thresh).logical_and_(ranks != cand.sum(-1, keepdim=True))     # rank M (1-based) exempt
    take = fails.cumsum(-1) == 0                       # no failing rank up to this one
    commit = torch.zeros_like(row, dtype=torch.bool).scatter_(1, order, take)
    return (commit if row.shape[1] == W else commit[:, off:off + W]) & cand


@functools.lru_cache(maxsize=64)
def column_indices(W: int, device: torch.device) -> torch.Tensor:
    """``[1, W]`` column indices ``0..W-1`` (made once per width and device; read only)."""
    return torch.arange(W, device=device)[None, :]


@functools.lru_cache(maxsize=256)
def column_range(start: int, stop: int, device: torch.device) -> torch.Tensor:
    """``[1, stop - start]`` column indices ``start..stop-1`` (made once per range and device; read only)."""
    return torch.arange(start, stop, device=device)[None, :]


@functools.lru_cache(maxsize=1024)
def _factor_thresholds(W: int, factor: float, dtype: torch.dtype, device: torch.device, exempt: int = -1):
    """``(ranks [1, W] float64, thresholds [1, W] in dtype)`` of the factor rule: ``1 - f / (n + 1)`` for rank
    ``n``, ``-1`` for the first (it always passes). Compared in the confidences' dtype, as torch compares them
    with the reference's Python-float thresholds. ``exempt`` (a 0-based rank, the last candidate's when the host
    knows it; -1: none): its threshold is ``-inf``, which no score fails (NaN included). The same for every step
    of a decode with that many candidates, so made once (read only)."""
    ranks = torch.arange(1, W + 1, device=device, dtype=torch.float64)
    thresh = 1.0 - (factor / (ranks + 1.0))
    thresh[0] = -1.0
    thresh = thresh.to(dtype)
    if exempt >= 0:
        thresh[exempt] = NEG_INF
    return ranks[None, :], thresh[None, :]


# -- the d2Cache framework's rules (docs/specs/d2cache.md §6): per row, at least ``min_tt`` commits -------------
def topk_rows(scores: torch.Tensor, k, largest: bool = True, lead: Optional[Sequence[int]] = None,
              cols: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """``[B, W]`` bool: the ``k[b]`` highest (``largest``) or lowest scores of every row (``cols = (lo, hi)``: only
    those columns of it, ``[B, hi - lo]``).

    ``k`` known on the host (an int or a sequence of ints): chosen as ``torch.topk(scores[b, lead[b]:], k[b])``
    chooses them (rows grouped by ``k`` and ``lead``), so exactly tied scores break as the references' per-row
    calls break them.
    ``k`` a device tensor (a data-dependent count): the first ``k[b]`` of a stable sort, with no host read; exact
    ties then break towards the lower position.
    """
    W = scores.shape[1]
    lo, hi = (0, W) if cols is None else cols

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t if (lo, hi) == (0, W) else t[:, lo:hi]

    if torch.is_tensor(k):
        order = torch.sort(scores, dim=-1, descending=largest, stable=True).indices
        take = column_indices(W, scores.device) < k[:, None]
        return cut(torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, order, take))
    ks = [int(k)] * scores.shape[0] if isinstance(k, int) else k
    if lead is None and all(kv == ks[0] for kv in ks):       # the common case: one call for every row
        if ks[0] <= 0:
            return torch.zeros((scores.shape[0], hi - lo), dtype=torch.bool, device=scores.device)
        idx = torch.topk(scores, min(int(ks[0]), W), dim=-1, largest=largest).indices
        if idx.shape[1] == 1:
            # one pick a row (LLaDA's one token a step): compared with the wanted columns' indices, one kernel where
            # scattering into a full row (and cutting the columns out) is two or three
            return column_range(lo, hi, scores.device) == idx
        return cut(torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, idx, True))
    out = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    for (kv, a), rows in _groups(_keys(ks, lead), scores.device):
        if kv <= 0:
            continue
        idx = torch.topk(scores[rows, a:], min(kv, W - a), dim=-1, largest=largest).indices + a
        out[rows] = out[rows].scatter(1, idx, True)
    return cut(out)


def factor_count(scores: torch.Tensor, cand: torch.Tensor, factor: float) -> torch.Tensor:
    """d2Cache's factor rule: the first rank ``n`` (1-based) of the sorted candidates with
    ``(n + 1) (1 - s_n) >= factor`` in float32, or ``|cand|`` when none; the row then commits ``n - 1``.
    Rows without candidates get 0 (the reference raises there, or reuses the previous row's ``n``)."""
    return _factor_count(masked_conf(scores, cand), cand, factor)


def _factor_count(c: torch.Tensor, cand: torch.Tensor, factor: float) -> torch.Tensor:
    """:func:`factor_count` of scores ``c`` that are ``-inf`` outside ``cand`` already."""
    W = c.shape[1]
    M = cand.sum(-1)
    s = torch.sort(c, dim=-1, descending=True).values
    n = torch.arange(1, W + 1, device=c.device)
    ok = ((n + 1).to(s.dtype)[None, :] * (1 - s) >= factor) & (n[None, :] <= M[:, None])
    first = torch.where(ok.any(-1), ok.to(torch.int64).argmax(-1) + 1, M)
    return torch.where(M > 0, first, torch.zeros_like(first))


def eb_count(scores: torch.Tensor, probs: torch.Tensor, gamma: float, over_ranks: bool = False) -> torch.Tensor:
    """EB-Sampler: how many of the ranked positions fit an entropy budget ``gamma``. Positions are ranked by
    score; ``A_k`` is the cumulative entropy of ranks ``<= k`` and ``M_k`` a running maximum; the row takes
    ``#{k : A_k - M_k <= gamma}``. The reference's running maximum runs over the *batch* at each rank
    (``over_ranks=False``, the default); ``over_ranks=True`` takes it over the ranks of the row."""
    order = torch.sort(scores, dim=-1, descending=True).indices
    H = torch.gather(_categorical_entropy(probs.float()), 1, order)
    A = torch.cumsum(H, dim=1)
    Mx = torch.cummax(H, dim=1 if over_ranks else 0).values
    return ((A - Mx) <= gamma).sum(-1)


def d2c_commit(scores: torch.Tensor, cand: torch.Tensor, min_tt: int, max_tt=None, *,
               counts: Optional[Sequence[int]] = None, threshold: Optional[float] = None,
               factor: Optional[float] = None, gamma: Optional[float] = None, probs: Optional[torch.Tensor] = None,
               eb_over_ranks: bool = False, ranked: bool = False) -> torch.Tensor:
    """The d2Cache framework's ``confidence_unmasking`` for every row at once (``[B, W]`` bool commits).

    ``threshold``: every candidate scoring ``>= threshold`` (none at all when more than ``max_tt`` do);
    ``factor``: the top ``n - 1`` of the factor rule; ``gamma``: the EB count (needs ``probs``). The count is
    clamped to ``[min_tt, max_tt]`` (``max_tt`` defaults to the candidates) and, when fewer than that were
    picked, the row commits its top-count candidates instead.

    ``counts`` (candidates per row) and ``max_tt`` known on the host make every top-count a host number, so
    the top-k picks are the reference's ``torch.topk`` picks (ties included) and nothing is read back; the
    factor rule's and EB's data-dependent counts use a stable sort instead. ``ranked``: ``scores`` is already
    ``-inf`` outside ``cand`` (it is ranked as it is).
    """
    if sum(x is not None for x in (threshold, factor, gamma)) > 1:
        raise ValueError("at most one of threshold, factor and gamma")
    if threshold is not None and min_tt == 0 and max_tt is None:
        return cand & (scores >= threshold)     # never too many, never a fallback (KLASS's stable set)
    c = scores if ranked else masked_conf(scores, cand)
    B = c.shape[0]
    if counts is None:                                  # the candidates are only known on the device
        M = cand.sum(-1)
        mx = M if max_tt is None else _ints(max_tt, c.device).expand(B)
        host = False
    else:
        M = list(counts)
        mx = M if max_tt is None else ([int(max_tt)] * B if isinstance(max_tt, int) else list(max_tt))
        host = True

    def lo(a, b):
        return torch.minimum(a, b) if not host else [min(x, y) for x, y in zip(a, b)]

    base = lo(mx, [min_tt] * B) if host else torch.clamp(mx, max=min_tt)      # clamp(min(min_tt, max), min_tt, max)
    if threshold is not None and max_tt is None:
        # at most every candidate passes, never more than max = |cand|: the count is min(min_tt, |cand|) <= |cand|
        picked = _passing(c, cand, threshold)
        top = topk_rows(c, base)
        return torch.where(_fewer(picked, base), top, picked)
    if threshold is not None and host:
        return capped_threshold(c, cand, threshold, M, mx, base)[0]
    if threshold is not None:
        picked = cand & (c >= threshold)
        n = picked.sum(-1)
        over = n > mx
        num = torch.where(over, mx, base)
        top = topk_rows(c, torch.minimum(M, num))
        picked = picked & ~over[:, None]
        return torch.where((picked.sum(-1) < num)[:, None], top, picked)
    if factor is not None:
        picked = topk_rows(c, _clamped(_factor_count(c, cand, factor) - 1, 0, mx))
        top = topk_rows(c, lo(M, base))
        return torch.where(_fewer(picked, base), top, picked)
    if gamma is not None:
        hi = mx if max_tt is None else lo(M, mx)        # (mx is M without max_tt)
        return topk_rows(c, _clamped(eb_count(c, probs, gamma, eb_over_ranks), min_tt, hi))
    # the fixed rate: min(min_tt, max) top candidates (without max_tt, base is that already)
    return topk_rows(c, base if max_tt is None else lo(M, base))


def capped_threshold(c: torch.Tensor, cand: torch.Tensor, threshold, M: Sequence[int], mx: Sequence[int],
                      base: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(commit, passing [B, 1])``: :func:`d2c_commit`'s threshold rule with a cap and the counts on the host (``M``: candidates, ``mx``: the
    cap, ``base``: ``min(min_tt, mx)``, per row; ``c`` is ``-inf`` outside ``cand``): the top ``min(M, mx)`` when
    more than ``mx`` pass, the top ``min(M, base)`` when fewer than ``base`` do, else the passing ones. The counts
    are compared with the number passing as host numbers (one Python int when every row has the same: no
    host-made tensor at batch 1) and one top-k serves both cases when their sizes agree -- the general form's
    picks (ties included) in about half its tensor ops."""
    picked = _passing(c, cand, threshold)
    n = picked.sum(-1, keepdim=True)
    k_over, k_base = [min(a, b) for a, b in zip(M, mx)], [min(a, b) for a, b in zip(M, base)]
    top_over = topk_rows(c, k_over)
    top_base = top_over if k_base == k_over else topk_rows(c, k_base)
    return torch.where(n > per_row(mx, c.device), top_over,
                       torch.where(n < per_row(base, c.device), top_base, picked)), n


def _passing(c: torch.Tensor, cand: torch.Tensor, threshold) -> torch.Tensor:
    """The candidates scoring ``>= threshold``, ``c`` being ``-inf`` outside ``cand``: no finite threshold passes
    there, so the comparison alone is the answer (one op); a ``-inf`` threshold (or a tensor of them) needs ``cand``."""
    if isinstance(threshold, (int, float)) and threshold > NEG_INF:
        return c >= threshold
    return cand & (c >= threshold)


def per_row(values: Sequence[int], device):
    """Per-row host numbers as one Python int when every row has the same (a batch of one: no copy), else a
    ``[B, 1]`` device tensor."""
    if all(v == values[0] for v in values):
        return values[0]
    return host_tensor([[v] for v in values], torch.long, device)


def _clamped(x: torch.Tensor, low: int, high) -> torch.Tensor:
    """``minimum(x.clamp_min(low), high)`` (``high``: per-row counts on the host or the device): one clamp when
    every row has the same host number (a clamp whose min exceeds its max gives the max, as the minimum does)."""
    if not torch.is_tensor(high) and all(v == high[0] for v in high):
        return x.clamp(low, high[0])
    return torch.minimum(x.clamp_min(low), _ints(high, x.device))


def _ints(values, device) -> torch.Tensor:
    """Per-row counts as a device tensor: host numbers are copied without a wait, tensors pass through."""
    return values if torch.is_tensor(values) else host_tensor(values, torch.long, device)


def masked_order(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of ``mask``'s true entries in row-major order (``mask.nonzero()`` as ``x[mask]`` visits
    them), given their number ``count`` on the host: ``nonzero_static`` of that size needs no host read (on CUDA
    too), and it is three operations where a stable sort of the inverted mask is five."""
    return torch.nonzero_static(mask.reshape(-1), size=count).view(-1)


def _fewer(picked: torch.Tensor, num) -> torch.Tensor:
    """``[B, 1]``: the rows of ``picked`` with fewer picks than ``num`` (per-row counts on the host or the
    device; one host number when every row has it: no copy)."""
    if not torch.is_tensor(num) and all(v == num[0] for v in num):
        return picked.sum(-1, keepdim=True) < num[0]
    return (picked.sum(-1) < _ints(num, picked.device))[:, None]


def _categorical_entropy(probs: torch.Tensor) -> torch.Tensor:
    """``torch.distributions.Categorical(probs=probs).entropy()`` bit for bit -- the same kernels on the same
    values (renormalise, clamp to ``[eps, 1 - eps]``, log, times the probabilities, sum) -- without building the
    distribution, and in place where Categorical allocates (the ``[..., V]`` temporaries are the big ones). Its
    ``clamp(min=finfo.min)`` of the logs is left out: the log of a value clamped to ``>= eps`` is finite or NaN,
    which that clamp returns unchanged."""
    p = probs / probs.sum(-1, keepdim=True)
    eps = torch.finfo(p.dtype).eps
    p_log_p = p.clamp(min=eps, max=1 - eps).log_().mul_(p)
    return -p_log_p.sum(-1)
