"""The one step loop: plan -> (cache + model forward) -> sampler -> select -> apply -> sinks."""
from __future__ import annotations

import time
from typing import Any, Iterable, Optional, Tuple

import torch

from .canvas import Canvas, FrameDelta
from .sampler import propose
from .strategy import StepPlan, Strategy


class Sink:
    """Receives every FrameDelta. Sinks must not branch on the strategy and must stay cheap.

    A sink with ``wants_logits = True`` gets the proposal's logits in ``delta.logits``.
    """

    wants_logits = False

    def on_start(self, canvas: Canvas, info: dict) -> None:
        pass

    def on_delta(self, delta: FrameDelta, canvas: Canvas) -> None:
        pass

    def on_end(self, canvas: Canvas) -> None:
        pass


class StalledDecode(RuntimeError):
    pass


def forward(model, canvas: Canvas, plan: StepPlan, cache) -> Tuple[torch.Tensor, Any]:
    """One model call for a plan (CFG doubles the batch; it still counts as one forward)."""
    ids, attn = canvas.tokens, canvas.attention_mask
    pos = canvas.position_ids
    cfg = plan.cfg_scale > 0
    if cfg:
        un = ids.masked_fill(canvas.given(), canvas.mask_id)
        ids, attn, pos = torch.cat([ids, un]), torch.cat([attn, attn]), torch.cat([pos, pos])
    extras = {"gen_start": canvas.gen_start}
    call = model(ids, attention_mask=attn if canvas.is_padded else None, position_ids=pos, hooks=cache,
                 logits_range=plan.window, directive=plan.cache, extras=extras)
    if tuple(call.logits_range) != tuple(plan.window):
        raise RuntimeError(f"cache '{getattr(cache, 'name', cache)}' cannot provide logits for columns "
                           f"{plan.window} (it computed {call.compute})")
    logits = call.logits
    if cfg:
        cond, uncond = logits.chunk(2, dim=0)
        logits = uncond + (plan.cfg_scale + 1) * (cond - uncond)
    if plan.suppress:  # in place, after CFG and before any noise (LLaDA's logits_eos_inf)
        logits[..., list(plan.suppress)] = float("-inf")
    return logits, call


def decode(model, canvas: Canvas, strategy: Strategy, cache=None, sinks: Iterable[Sink] = (),
           max_steps: Optional[int] = None) -> Canvas:
    """Decode ``canvas`` in place with ``strategy``; every step's delta goes to ``sinks``."""
    from .registry import cache_class

    if cache is None:
        cache = cache_class("none")(cache_class("none").Config())
    sinks = list(sinks)
    want_logits = any(getattr(s, "wants_logits", False) for s in sinks)  # e.g. trace capture=topk|logits
    cache.begin(canvas)
    state = strategy.init_state(canvas)
    for s in sinks:
        s.on_start(canvas, {"strategy": strategy.name})
    limit = max_steps if max_steps is not None else 4 * canvas.gen_length + 64
    t0 = time.perf_counter()
    with torch.inference_mode():
        while True:
            plan = strategy.plan(canvas, state)
            if plan is None:
                break
            if canvas.step >= limit:
                raise StalledDecode(f"strategy '{strategy.name}' did not finish within {limit} steps "
                                    "(did the model propose the mask token?)")
            logits, call = forward(model, canvas, plan, cache)
            proposal = propose(
                logits, plan.window[0], temperature=plan.temperature, confidence=plan.confidence,
                softmax_dtype=plan.softmax_dtype, call_len=call.compute[1] - call.compute[0],
                call_start=call.compute[0], top_v=plan.top_v, discard_draws=call.extras.get("discard_draws", 0),
            )
            delta, state = strategy.select(canvas, plan, proposal, state)
            delta.wall_time = time.perf_counter() - t0
            if want_logits:
                delta.logits = proposal.logits
            canvas.apply(delta)
            for s in sinks:
                s.on_delta(delta, canvas)
    cache.end(canvas)
    for s in sinks:
        s.on_end(canvas)
    return canvas
