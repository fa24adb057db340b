"""The one step loop: plan -> (cache + model forward) -> sampler -> select -> apply -> sinks."""
from __future__ import annotations

import contextlib
import math
import time
from typing import Iterable, Optional, Tuple

import torch

from dlm_engine.core.canvas import NO_MODEL_INFO, Canvas, FrameDelta, ModelInfo
from dlm_engine.core.capabilities import model_incompatibility
from dlm_engine.core.protocol import CallRequest, ForwardCall
from dlm_engine.core.registry import cache_class
from dlm_engine.core.rows import ActiveRows, call_rows, expand_proposal, full_batch, idle_proposal, recomputed_rows
from dlm_engine.core import sampler
from dlm_engine.core.fast.layer import fast_paths, plain_policy
from dlm_engine.core.fast.scored import scored_window
from dlm_engine.core.sampler import Proposal, propose
from dlm_engine.core.strategy import StepPlan, Strategy
from dlm_engine.errors import ConfigError, check_finite_logits



class Sink:
    """Receives every FrameDelta. Sinks must not branch on the strategy and must stay cheap.

    A sink with ``wants_logits = True`` gets the proposal's logits in ``delta.logits``; one with
    ``wants_recomputed = True`` gets the per-step scalar ``recomputed`` (``[B, L]`` bool: the canvas columns whose
    keys/values the step's model call recomputed, :func:`dlm_engine.core.rows.recomputed_rows`).
    """

    wants_logits = False
    wants_recomputed = False

    def on_start(self, canvas: Canvas, info: dict) -> None:
        pass

    def on_delta(self, delta: FrameDelta, canvas: Canvas) -> None:
        pass

    def on_end(self, canvas: Canvas) -> None:
        pass


class StalledDecode(RuntimeError):
    pass


def forward(model, canvas: Canvas, plan: StepPlan, cache, rows: Optional[torch.Tensor] = None,
            live: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ForwardCall]:
    """One model call for a plan (CFG doubles the batch; it still counts as one forward).

    ``rows``: run only these canvas rows (ascending); the logits then have ``len(rows)`` rows and the cache
    learns which rows of the full batch they are (``CallRequest.rows``) and which rows are not finished
    (``live``, a superset: the others sit this step out).
    """
    ids, attn = canvas.tokens, canvas.attention_mask
    pos = canvas.position_ids if plan.position_ids is None else plan.position_ids
    cfg = plan.cfg_scale > 0
    given = canvas.given() if cfg else None
    if rows is not None:
        ids, attn, pos = ids[rows], attn[rows], pos[rows]
        given = given[rows] if cfg else None
    if cfg:
        un = ids.masked_fill(given, canvas.mask_id)
        ids, attn, pos = torch.cat([ids, un]), torch.cat([attn, attn]), torch.cat([pos, pos])
    aux = plan.aux if plan.aux is None or rows is None else plan.aux.take(rows)
    soft = plan.soft
    if soft is not None:
        soft = soft.take(rows) if rows is not None else soft
        soft = soft.doubled() if cfg else soft
    request = CallRequest(gen_start=canvas.gen_start, directive=plan.cache, aux=aux, soft=soft)
    if rows is not None:
        request.rows, request.full_batch = call_rows(rows, canvas.batch_size, cfg)
        request.live = None if live is None else call_rows(live, canvas.batch_size, cfg)[0]
    elif live is not None:                      # cannot happen: rows default to the live rows
        raise AssertionError("live rows without call rows")
    call = model(ids, attention_mask=attn if canvas.is_padded else None, position_ids=pos, hooks=cache,
                 logits_range=plan.window, request=request)
    logits = call.logits
    if cfg:
        cond, uncond = logits.chunk(2, dim=0)
        logits = uncond + (plan.cfg_scale + 1) * (cond - uncond)
        if call.valid is not None:
            call.valid = call.valid.chunk(2, dim=0)[0]
    if plan.suppress:  # in place, after CFG and before any noise (LLaDA's logits_eos_inf)
        sampler.suppress_(logits, plan.suppress)
    return logits, call


def sample(logits: torch.Tensor, plan: StepPlan, call: ForwardCall, rows: Optional[torch.Tensor] = None,
           canvas: Optional[Canvas] = None, run: Optional[Tuple[bool, ...]] = None,
           all_confidences: bool = False) -> Proposal:
    """The shared sampler on a call's window (or the bare logits of the call's canvas ``rows`` when the plan
    samples itself). ``canvas`` and ``run`` (the host flags of the call's rows) serve ``StepPlan.masked``, which
    is ignored with ``all_confidences`` (a cache reads every position's confidence) and for confidence kinds
    outside ``sampler.ROW_EXACT_KINDS``."""
    start = plan.window[0]
    if not plan.sample:
        return Proposal(start=start, x0=None, confidence=None, logits=logits, valid=call.valid, rows=rows,
                        aux_logits=call.aux_logits)
    cols = call.columns
    if cols.is_span:
        call_len, call_start = cols.end - cols.start, cols.start
    else:   # per-row column sets: random draws have the window's shape
        call_len, call_start = logits.shape[1], start
    scored = mask = None
    if plan.masked is not None and canvas is not None and not all_confidences:   # the fast layer's scored path
        scored, mask = scored_window(logits, plan, canvas, rows, run)
    proposal = propose(logits, start, temperature=plan.temperature, confidence=plan.confidence,
                       softmax_dtype=plan.softmax_dtype, call_len=call_len, call_start=call_start, top_v=plan.top_v,
                       discard_draws=call.discard_draws, valid=call.valid, scored=scored)
    if scored is not None:
        proposal.masked = mask          # (full batch: before the rows were taken)
        proposal.masked_confidence = plan.confidence != "random"      # (propose draws random ones everywhere)
    return proposal


def decode(model, canvas: Canvas, strategy: Strategy, cache=None, sinks: Iterable[Sink] = (),
           max_steps: Optional[int] = None, compact: bool = True, fast: bool = True) -> Canvas:
    """Decode ``canvas`` in place with ``strategy``; every step's delta goes to ``sinks``.

    A strategy's set-up (constraints, an initial canvas) arrives as a step-0 delta before the first step.
    ``compact``: once rows are finished, run the model on the active rows only (:mod:`dlm_engine.core.rows`);
    a step the strategy schedules after every row finished still runs one (discarded) forward, so
    ``canvas.nfe`` always equals the number of model calls.

    Host synchronisation: once per step, after the delta is applied, the loop reads the finished rows and what the
    strategy's next plan must know (:meth:`Strategy.reads`) in a single transfer and hands the values to
    :meth:`Strategy.settle` before the sinks see the delta. Plans decide on those host values alone.

    ``fast=False`` runs the plain path (:mod:`dlm_engine.core.fast`): the strategy with its fast mixins off
    (:func:`~dlm_engine.core.fast.layer.plain_policy`), confidences at every position (``StepPlan.masked``
    ignored, and ``Proposal.all_confidences`` set, as under a cache that reads every confidence) and torch's own
    vocabulary maximum (:mod:`dlm_engine.core.fast.row_max`). It makes the same deltas (tests/test_plain_fast.py),
    with more work on the device.
    """
    if not fast:
        strategy = plain_policy(strategy)
    if strategy.max_batch is not None and canvas.batch_size > strategy.max_batch:
        raise ValueError(f"strategy '{strategy.name}' decodes at most {strategy.max_batch} row(s) at a time "
                         f"(max_batch); this canvas has {canvas.batch_size}: split the batch (decode_batch does)")
    problem = model_incompatibility(strategy, model)
    if problem is not None:
        raise ConfigError(problem)
    if cache is None:
        cache = cache_class("none")()
    if canvas.model_info is NO_MODEL_INFO or canvas.model_info == NO_MODEL_INFO:
        canvas.model_info = ModelInfo.of(model)
    sinks = list(sinks)
    want_logits = any(getattr(s, "wants_logits", False) for s in sinks)  # e.g. trace capture=topk|logits
    want_recomputed = any(getattr(s, "wants_recomputed", False) for s in sinks)   # e.g. trace.recomputed=true
    all_conf = bool(getattr(cache, "reads_confidence", False)) or not fast
    cache.begin(canvas)
    for s in sinks:
        s.on_start(canvas, {"strategy": strategy.name})
    setup = strategy.prepare(canvas)
    if setup is not None:
        canvas.apply(setup)
        for s in sinks:
            s.on_delta(setup, canvas)
    state = strategy.init_state(canvas)
    limit = max_steps if max_steps is not None else strategy.max_steps(canvas)
    active = ActiveRows(canvas, compact)
    with fast_paths(fast):
        _steps(model, canvas, strategy, cache, sinks, state, limit, active, want_logits, want_recomputed, all_conf)
    cache.end(canvas)
    for s in sinks:
        s.on_end(canvas)
    return canvas


def _steps(model, canvas: Canvas, strategy: Strategy, cache, sinks, state, limit, active: ActiveRows,
           want_logits: bool, want_recomputed: bool, all_conf: bool) -> None:
    """The steps of :func:`decode`, from its first host read to the plan that ends it."""
    host, state = sync_round(canvas, strategy, state, None)     # what the first plan reads
    t0 = time.perf_counter()
    # (a caller already in inference mode -- decode_batch, the benchmarks -- costs no second enter and exit a decode)
    with contextlib.nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode():
        while True:
            plan, state = strategy.plan(canvas, state)
            if plan is None:
                break
            if canvas.step >= limit:
                raise StalledDecode(f"strategy '{strategy.name}' did not finish within {limit} steps "
                                    "(did the model propose the mask token?)")
            live, rows = active.rows_for(host.finished, plan.rows)
            call = finite = None
            if active.none_active:
                # Every row is finished but the strategy still schedules a step (LLaDA's zero-transfer
                # steps): the reference runs that forward, and NFE counts model calls, so run it (uncached:
                # caches may have dropped finished rows) and discard it; nothing can be committed.
                forward(model, canvas, plan, None)
                proposal = idle_proposal(canvas, plan.window, active.vocab)
            else:
                logits, call = forward(model, canvas, plan, cache, rows=rows, live=live)
                first = active.vocab is None    # the first forward: NaN weights or fp16 overflow end the decode
                if first:
                    active.seen(logits)
                proposal = sample(logits, plan, call, rows, canvas, active.run, all_conf)
                if first:
                    finite = confidence_health(plan, proposal)
                    if finite is None:
                        finite = all_finite(logits)
                if rows is not None and plan.sample:
                    proposal = expand_proposal(proposal, rows, canvas)
            proposal.active, proposal.pads, proposal.all_confidences = active.mask, canvas.pads, all_conf
            delta, state = strategy.select(canvas, plan, proposal, state)
            delta.wall_time = time.perf_counter() - t0
            if want_logits:
                delta.logits = delta_logits(proposal, delta, rows, canvas)
            cache.after_step(canvas, delta, call)
            if want_recomputed:
                delta.scalars["recomputed"] = recomputed_rows(canvas, call, rows)
            canvas.apply(delta)
            host, state = sync_round(canvas, strategy, state, delta, finite)
            if host.bad:
                check_finite_logits(logits)             # describes the problem and raises
            for s in sinks:
                s.on_delta(delta, canvas)


class HostView:
    """What the loop read from the device in a step's one synchronisation (``finished``: a tuple of flags, one per
    row)."""

    __slots__ = ("finished", "values", "bad")

    def __init__(self, finished, values, bad):
        self.finished, self.values, self.bad = finished, values, bad


def sync_round(canvas: Canvas, strategy: Strategy, state, delta: Optional[FrameDelta],
               finite: Optional[torch.Tensor] = None):
    """The one host read of a step: the finished rows, the first forward's health (``finite``, see
    :func:`all_finite`) and what the strategy's next plan reads (:meth:`Strategy.reads`), in one transfer; returns
    ``(HostView, the state after Strategy.settle)``."""
    req = strategy.reads(canvas, state)
    parts = [canvas.finished]
    if finite is not None:
        parts.append(finite)
    asked = () if req is None else req if isinstance(req, (tuple, list)) else (req,)
    parts.extend(t if t.dim() == 1 else t.reshape(-1) for t in asked)   # (any shape, flattened, read in order)
    flat = torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()   # cat promotes to one dtype
    B = canvas.batch_size
    n_flag = 0 if finite is None else int(finite.shape[0])
    rest = flat[B + n_flag:]
    if finite is not None and not any(p.is_floating_point() for p in parts if p is not finite):
        rest = [int(v) for v in rest]       # (the health values made the cat float: the rest were integers)
    host = HostView(tuple(bool(v) for v in flat[:B]), rest, finite is not None and not healthy(flat[B:B + n_flag]))
    return host, strategy.settle(canvas, state, host.values, delta)


def delta_logits(proposal: Proposal, delta: FrameDelta, rows: Optional[torch.Tensor],
                 canvas: Canvas) -> Optional[torch.Tensor]:
    """``delta.logits`` for a sink that wants them: ``[B, W, V]`` over the delta's own window, full batch (a plan
    that samples itself gets its call rows' logits over its window; rows the call did not run get zeros). None
    when the delta's window reaches outside the logits'."""
    lg = proposal.logits
    if rows is not None and lg.shape[0] != canvas.batch_size:
        lg = full_batch(lg, rows, canvas.batch_size, 0)
    a, W = delta.start - proposal.start, delta.commit.shape[1]
    if a < 0 or a + W > lg.shape[1]:
        return None
    return lg if (a == 0 and W == lg.shape[1]) else lg[:, a:a + W]


def all_finite(logits: torch.Tensor) -> torch.Tensor:
    """``[rows]`` on the device: a number per row that is finite exactly when the row is healthy (:func:`healthy`): no
    NaN, no +inf, no position whose logits are all -inf. A position's maximum is finite exactly when none of these
    holds (``amax`` propagates NaN), and the float64 sum of a row's position maxima is finite exactly when every
    one of them is (a NaN or +inf maximum makes it NaN or +inf, an all -inf position -inf or NaN): two kernels,
    compared with the infinities on the host after the step's one read (``isfinite`` alone is four). Float64, so
    that integers read in the same ``cat`` stay exact up to 2^53 and so that the sum cannot overflow: maxima of at
    most float32's largest value (float32, bfloat16 and float16 logits) summed over any sequence length stay far
    below float64's. Float64 logits (whose sum could overflow) and MPS (no float64) take each row's largest
    ``|max|`` instead: a norm, also two kernels, but one that costs more than the sum on a CPU's cold caches
    (~37-47 against ~25-28 µs after a forward of the embedded model). A call with no positions is healthy (decided
    on the shape)."""
    dtype = torch.float32 if logits.device.type == "mps" else torch.float64      # (MPS has no float64)
    if logits.shape[-2] == 0:
        return torch.zeros(logits.shape[:-2], dtype=dtype, device=logits.device)
    if logits.dtype == torch.float64 or dtype != torch.float64:
        return torch.linalg.vector_norm(logits.amax(dim=-1), ord=math.inf, dim=-1, dtype=dtype)
    return logits.amax(dim=-1).sum(-1, dtype=torch.float64)


# confidence kinds made from the softmax of a position's logits (without a top-V cut): NaN exactly where the position
# is unhealthy (see :func:`confidence_health`)
HEALTH_FROM_CONFIDENCE = ("prob", "margin", "entropy", "inv_entropy")


def confidence_health(plan: StepPlan, proposal: Proposal) -> Optional[torch.Tensor]:
    """:func:`all_finite`'s values from the first step's confidences instead of its logits: one kernel over ``[B, W]``
    for two over ``[B, W, V]``. A confidence made from the softmax of a position's logits (``prob``, ``margin``,
    ``entropy``, ``inv_entropy``, none cut to a top-V) is NaN exactly where the position is unhealthy (a NaN or a +inf
    logit, or every logit -inf, makes the whole softmax NaN) and a finite number in ``[0, 1]`` elsewhere, so the
    float64 sum of a row's confidences is finite exactly when the row is healthy. None where the confidences do
    not cover the call's positions that way (random draws, a top-V cut, columns left out or scored, a plan that
    samples itself, MPS without float64) and for CadLLM's ``inv_entropy`` made in float16, whose ``log(p + 1e-12)``
    of a probability that underflowed to 0 (1e-12 is 0 there: the spec's formula) makes healthy positions NaN too:
    the logits are checked then."""
    conf = proposal.confidence
    if (conf is None or not plan.sample or plan.confidence not in HEALTH_FROM_CONFIDENCE or plan.top_v is not None
            or proposal.valid is not None or proposal.masked_confidence or conf.device.type == "mps"
            or conf.dim() != 2 or (conf.dtype == torch.float16 and plan.confidence == "inv_entropy")):
        return None
    return conf.sum(-1, dtype=torch.float64)


def healthy(values) -> bool:
    """Whether the :func:`all_finite` values read on the host say every row is healthy (NaN compares False)."""
    return all(-math.inf < v < math.inf for v in values)
