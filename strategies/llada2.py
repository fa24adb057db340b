"""``llada2``: LLaDA2.0's block decoding (``LLaDA2MoeModelLM.generate``), written from the SPEC in
``tests/fixtures/bdparity/README.md`` (section ``llada2``, S3).

Blocks of ``block_length`` are aligned to canvas column 0 (absolute position 0, as the model's block-causal
mask): the first decoded block is the one holding the prompt's end, so it may start inside the prompt. Each
block gets at most ``steps`` forwards (``steps`` capped at ``gen_length // minimal_topk``); step ``s`` must commit
``n_k(s) = block_length // steps + [s < block_length % steps]`` positions. A step samples every position of the
block (greedy: argmax of the float32 softmax; else temperature, top-k, top-p, one ``torch.multinomial`` over the
block), then commits the masked positions whose confidence is ``> threshold`` when there are at least ``n_k(s)``
of them, else the ``n_k(s)`` most confident masked positions. A block ends when it has no mask left (no forward)
or after ``steps`` forwards.

Stops: decoding ends after the block in which an EOS was written (always, as the reference); with
``eos_early_stop`` also right after a step that commits an EOS, when no mask precedes the first EOS. The reference
searches that first EOS over the whole window, prompt included (``eos_search: window``, quirk 3: a prompt
holding the EOS returns an empty answer); ``eos_search: generation`` is the corrected search.

Use the canvas the reference decodes (``gen_length`` rounded up so that prompt + generation fills whole blocks)
for identical tokens; a shorter canvas cuts the last block. Batch 1 (as the reference); ``decode_batch`` splits.
No cache is the reference's path (it recomputes every finished block at every step; the model then runs only
the columns up to the block's end); ``cache=block_store`` stores finished blocks and computes only the working
block (``CacheDirective.store``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.strategy import CacheDirective, StepPlan, Strategy, evolve
from dlm_engine.errors import ConfigError

EOS_SEARCH = ("window", "generation")


@dataclass
class LLaDA2Config:
    block_length: int = 32               # block size of the schedule and of the model's block-causal mask
    steps: int = 32                      # forwards per block at most (capped at gen_length // minimal_topk)
    threshold: float = 0.95              # commit masked positions with confidence > threshold ...
    minimal_topk: int = 1                # ... when at least n_k(step) pass it, else the n_k(step) most confident
    temperature: float = 0.0             # 0 = greedy
    top_k: Optional[int] = None          # sampling only: keep the top-k logits (ties kept)
    top_p: Optional[float] = None        # sampling only: nucleus (the crossing token kept)
    eos_early_stop: bool = False         # stop right after a step that commits an EOS with no mask before it
    eos_search: str = "window"           # window: the first EOS of the whole window, prompt included (reference);
                                         # generation: the first EOS of the generated part


@dataclass(frozen=True)
class LLaDA2State:
    block: int = -1                      # absolute block index (column // block_length); -1 = not started
    first: int = 0                       # the first decoded block (the one holding the generation start)
    step: int = 0                        # forwards spent in the block
    counts: Tuple[int, ...] = ()         # masked positions per absolute block (host)
    eos_blocks: Tuple[int, ...] = ()     # per absolute block: an EOS is written at a generated position (host)
    done: bool = False
    empty: bool = False                  # stopped by an EOS inside the prompt (the reference returns nothing)
    stop_reason: str = ""


def schedule(block_length: int, steps: int) -> Tuple[int, ...]:
    """``n_k(s)``: commits step ``s`` must make (the block's positions spread over the steps, the first ones
    one more; 0 when steps exceed the block)."""
    base, rem = divmod(block_length, steps)
    return tuple(base + (1 if s < rem else 0) for s in range(steps))


def sample_block(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float],
                 greedy_argmax_of_logits: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x0, conf)`` for float32 ``logits`` ``[W, V]``: greedy = argmax of the softmax (``greedy_argmax_of_logits``:
    of the logits) with its probability; else temperature, top-k (values below the k-th largest dropped), top-p
    (sorted cumulative softmax, shifted by one), softmax and one ``torch.multinomial`` over all W rows."""
    if temperature <= 0:
        p = F.softmax(logits, dim=-1)
        x0 = (logits if greedy_argmax_of_logits else p).argmax(-1)
        return x0, p.gather(-1, x0[:, None]).squeeze(-1)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(int(top_k), logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        srt, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.cumsum(F.softmax(srt, dim=-1), dim=-1)
        drop = torch.zeros_like(cum, dtype=torch.bool)
        drop[..., 1:] = cum[..., :-1] > top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    p = F.softmax(logits, dim=-1)
    x0 = torch.multinomial(p, num_samples=1)
    return x0.squeeze(-1), p.gather(-1, x0).squeeze(-1)


class AbsoluteBlocks(Strategy):
    """Shared geometry of the LLaDA2.x decoders: blocks aligned to column 0, one row, host facts per block."""

    offers = caps(Cap.BLOCKS, Cap.BLOCK_HANDOVER)
    needs = caps()
    max_batch = 1
    sets_attention_blocks = True          # every plan names its mask's block size (CacheDirective.attention_block)

    def validate(self) -> None:
        c = self.cfg
        self.check_positive("block_length", c.block_length)
        self.bl = int(c.block_length)
        self.check_unit_interval("threshold", c.threshold)
        self.check_non_negative("temperature", c.temperature)
        if c.top_k is not None and int(c.top_k) < 0:
            raise ConfigError(f"strategy.top_k={c.top_k} must be >= 0 (null = off)")
        if c.top_p is not None and not 0.0 < float(c.top_p) <= 1.0:
            raise ConfigError(f"strategy.top_p={c.top_p} is outside (0, 1] (null = off)")
        if c.eos_search not in EOS_SEARCH:
            raise ConfigError(f"strategy.eos_search='{c.eos_search}' (choose {', '.join(EOS_SEARCH)})")

    # -- geometry -------------------------------------------------------------------------------------------------
    def n_blocks(self, canvas) -> int:
        return -(-canvas.length // self.bl)

    def bounds(self, canvas, block: int) -> Tuple[int, int]:
        """Canvas columns of absolute block ``block`` (the last one cut at the canvas end)."""
        return block * self.bl, min((block + 1) * self.bl, canvas.length)

    def per_block(self, flags: torch.Tensor, canvas) -> torch.Tensor:
        """``[NB]`` sums per absolute block of a ``[L]`` flag row."""
        nb = self.n_blocks(canvas)
        pad = nb * self.bl - flags.shape[0]
        f = F.pad(flags.long(), (0, pad)) if pad else flags.long()
        return f.view(nb, self.bl).sum(-1)

    def block_facts(self, canvas) -> list:
        """Masked positions per block and, per block, whether an EOS is written at a generated position."""
        masked = canvas.step_of[0] < 0
        parts = [self.per_block(masked, canvas)]
        if canvas.eos_id is not None:
            eos = (canvas.tokens[0] == canvas.eos_id) & ~masked
            eos[:canvas.gen_start] = False
            parts.append(self.per_block(eos, canvas).clamp_max(1))
        else:
            parts.append(torch.zeros(self.n_blocks(canvas), dtype=torch.long, device=canvas.device))
        return parts

    def first_block(self, canvas) -> int:
        return canvas.gen_start // self.bl

    # -- what the next plan must know: the block facts, then what the rule reads of the last step ----------------
    def reads(self, canvas, st):
        return self.block_facts(canvas) + self.step_facts(canvas, st)

    def step_facts(self, canvas, st) -> list:
        """What the rule reads of the step just taken, after the block facts (tensors; none by default)."""
        return []

    def with_facts(self, canvas, st, values):
        """The state with the block facts of ``values``, and the values of :meth:`step_facts`."""
        nb = self.n_blocks(canvas)
        counts, eos = tuple(int(v) for v in values[:nb]), tuple(int(v) for v in values[nb:2 * nb])
        return evolve(st, counts=counts, eos_blocks=eos), [int(v) for v in values[2 * nb:]]

    def eos_in_generation(self, st, block: int) -> bool:
        return any(st.eos_blocks[st.first:block + 1])

    def plan_step(self, canvas, st, store) -> StepPlan:
        s, e = self.bounds(canvas, st.block)
        return StepPlan(window=(s, e), sample=False, temperature=float(self.cfg.temperature),
                        cache=CacheDirective(block=(s, e), block_start=st.step == 0,
                                             step_in_block=st.step, store=store, attention_block=self.bl))

    def eos_written(self, canvas, commit: torch.Tensor, x0: torch.Tensor, s: int, e: int) -> torch.Tensor:
        """0-dim bool on the device: an EOS stands at a generated position before ``e`` once this step's writes
        (``commit`` / ``x0`` over ``[s, e)``) are applied."""
        eos = canvas.eos_id
        if eos is None:
            return torch.zeros((), dtype=torch.bool, device=canvas.device)
        g = canvas.gen_start
        lo = max(s, g)
        toks = canvas.tokens[0, g:e].clone()
        written = canvas.step_of[0, g:e] >= 0
        toks[lo - g:] = torch.where(commit[lo - s:], x0[lo - s:], toks[lo - g:])
        written[lo - g:] |= commit[lo - s:]
        return ((toks == eos) & written).any()

    def max_steps(self, canvas) -> int:
        return self.n_blocks(canvas) * (int(getattr(self.cfg, "steps", 1) or 1) + 64) + 64


@register_strategy("llada2", LLaDA2Config)
class LLaDA2(AbsoluteBlocks):
    def validate(self) -> None:
        super().validate()
        c = self.cfg
        self.check_positive("steps", c.steps)
        self.check_positive("minimal_topk", c.minimal_topk)
        self.steps = min(int(c.steps), self.gen_length // int(c.minimal_topk))
        if self.steps <= 0:
            raise ConfigError(f"strategy.minimal_topk={c.minimal_topk} leaves no step for gen_length={self.gen_length} "
                              "(steps = min(steps, gen_length // minimal_topk) must be >= 1)")
        self.nk = schedule(self.bl, self.steps)

    def init_state(self, canvas):
        return LLaDA2State(first=self.first_block(canvas))

    def step_facts(self, canvas, st: LLaDA2State) -> list:
        """With ``eos_early_stop``: the EOS facts of the canvas (:meth:`eos_facts`), after the step's writes."""
        if not self.early_stop(canvas) or st.block < 0:
            return []
        s, e = self.bounds(canvas, st.block)
        written = canvas.step_of[0, s:e] == canvas.step          # the positions the step committed
        hit = (written & (canvas.tokens[0, s:e] == canvas.eos_id)).any()
        return [self.eos_facts(canvas, hit, canvas.tokens[0, :e], canvas.step_of[0, :e] < 0)]

    def settle(self, canvas, st: LLaDA2State, values, delta):
        st, rest = self.with_facts(canvas, st, values)
        if delta is None:                                    # before the first step
            return evolve(st, block=st.first, step=0)
        hit, first, before = rest if rest else (0, -1, 0)
        if hit and first >= 0 and before == 0:
            reason = "eos_prompt" if first < canvas.gen_start else "eos_early_stop"
            delta.scalars["stop"] = reason               # (eos_prompt: the reference returns an empty answer)
            return evolve(st, done=True, empty=first < canvas.gen_start, stop_reason=reason)
        b = st.block
        if st.counts[b] == 0 or st.step + 1 >= self.steps:
            s, e = self.bounds(canvas, b)
            delta.block_events.append(BlockEvent("completed", b - st.first, max(s, canvas.gen_start), e))
            return self.next_block(canvas, evolve(st, step=0), b)
        return evolve(st, step=st.step + 1)

    def next_block(self, canvas, st: LLaDA2State, b: int) -> LLaDA2State:
        """After block ``b``: stop when an EOS was written in the generation so far, else the next block."""
        if self.eos_in_generation(st, b):
            return evolve(st, done=True, stop_reason="eos_block")
        if b + 1 >= self.n_blocks(canvas):
            return evolve(st, done=True, stop_reason="end")
        return evolve(st, block=b + 1, step=0)

    def plan(self, canvas, st: LLaDA2State):
        while not st.done and st.step == 0 and st.counts[st.block] == 0:   # a block without masks: no forward
            st = self.next_block(canvas, st, st.block)
        if st.done:
            return None, st
        store = []
        if st.step == 0 and st.block > st.first:          # the finished block before it
            store = [self.bounds(canvas, st.block - 1)]
        return self.plan_step(canvas, st, store), st

    def select(self, canvas, plan, proposal, st: LLaDA2State):
        c = self.cfg
        s, e = plan.window
        logits = proposal.logits[0].float()
        x0, conf = sample_block(logits, float(c.temperature), c.top_k, c.top_p)
        masked = canvas.step_of[0, s:e] < 0
        conf_m = torch.where(masked, conf, torch.full_like(conf, float("-inf")))
        nk = self.nk[st.step]
        high = conf_m > float(c.threshold)
        n_high = high.sum()
        n_mask = st.counts[st.block]
        k = min(nk, n_mask)
        top = torch.zeros_like(high)
        if k > 0:
            top[torch.topk(conf_m, k).indices] = True
        commit = torch.where(n_high >= nk, high, top)
        events = [BlockEvent("opened", st.block - st.first, max(s, canvas.gen_start), e)] if st.step == 0 else []
        # the row is finished when this step ends the decode (as ``settle`` will tell on the host): an early EOS stop,
        # or the block's end with an EOS written in the generation or no block after it
        block_end = ~(masked & ~commit).any() if st.step + 1 < self.steps else torch.ones((), dtype=torch.bool,
                                                                                           device=canvas.device)
        last = st.block + 1 >= self.n_blocks(canvas)
        end = block_end & (self.eos_written(canvas, commit, x0, s, e) | last)
        if self.early_stop(canvas):      # the same facts settle reads, on the canvas as this step leaves it
            toks = canvas.tokens[0, :e].clone()
            toks[s:e] = torch.where(commit, x0, toks[s:e])
            left = canvas.step_of[0, :e] < 0
            left[s:e] &= ~commit
            hit, first, before = self.eos_facts(canvas, (commit & (x0 == canvas.eos_id)).any(), toks, left)
            end = end | ((hit > 0) & (first >= 0) & (before == 0))
        delta = self.delta(canvas, proposal, commit[None], tokens=x0[None], confidence=conf[None].float(),
                           events=events, finished=end[None],
                           scalars={"block": st.block, "committed": commit.sum()[None]})
        return delta, st

    def early_stop(self, canvas) -> bool:
        return self.cfg.eos_early_stop and canvas.eos_id is not None

    def eos_facts(self, canvas, hit: torch.Tensor, toks: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """``[the step committed an EOS (hit), first EOS column (-1: none), masks in the generation before it]`` of
        row 0's columns ``[0, e)`` (``toks``, ``masked``), the EOS searched from column ``lo`` (0 with ``eos_search:
        window``, else the generation start)."""
        dev = canvas.device
        g = canvas.gen_start
        lo = 0 if self.cfg.eos_search == "window" else g
        is_eos = (toks == canvas.eos_id) & ~masked
        is_eos[:lo] = False
        first = torch.where(is_eos.any(), is_eos.long().argmax(), torch.tensor(-1, device=dev))
        col = torch.arange(toks.shape[0], device=dev)
        before = (masked & (col >= g) & (col < first)).sum()
        return torch.stack([hit.long(), first, before])


__all__ = ["LLaDA2Config", "LLaDA2", "AbsoluteBlocks", "sample_block", "schedule"]
