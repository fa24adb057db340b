"""``sdar``: SDAR's block-diffusion decoding (JetAstra/SDAR), both of its samplers.

Blocks of ``block_length`` are aligned at absolute column 0: the first block holds the prompt's tail, the
canvas ends on a block boundary (the reference generates ``ceil((P + G)/B)·B - P`` tokens; :func:`sdar_gen_length`).
The prompt's full blocks are prefilled (one forward, stored); each block then takes up to ``denoising_steps``
decode forwards and, once it has no mask left, one **store** forward that writes its keys/values (every forward
counts in NFE). After a block is stored, the decode stops if a stop id occurs anywhere in the generation.

Per decode step ``i`` a block commits ``n_k[i] = B // S + (i < B % S)`` positions (``S = denoising_steps``), or
with ``threshold < 1`` every masked position whose confidence exceeds it when there are at least ``n_k[i]``.

* ``sampler: eval`` -- the paper's evaluation sampler (``huggingface_bd3.block_diffusion_generate``):
  ``remasking`` ``low_confidence`` (confidence = the unfiltered softmax probability of the sampled token) or
  ``random`` (Gumbel-max sample, uniform confidences); it draws an unused float64 Gumbel tensor every step
  (reproduced for seeded parity) and requires ``block_length % denoising_steps == 0``.
* ``sampler: generate`` -- ``generate.py``: ``remasking`` ``low_confidence_static``,
  ``low_confidence_dynamic`` (with ``threshold``) or ``sequential``; the confidence is the *filtered*
  probability (1.0 for every position with ``top_k = 1``), and a step whose ``n_k`` exceeds the masks left also
  takes non-mask positions -- the reference **overwrites** them (the prompt tail, earlier tokens) with fresh
  samples (``overwrite: true``, the default; ``false`` keeps them, the corrected behaviour).

Reference quirks kept: a sampled ``<MASK>`` is committed like any token (the position stays masked and is
predicted again; masks left after ``denoising_steps`` steps are an error, as the reference's ``IndexError``);
``temperature`` must be > 0 (greedy is ``top_k = 1``). ``entropy_bounded`` (crashes in the reference) is
refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import List, Optional

import torch

from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.strategy import CacheDirective, StepPlan, evolve
from dlm_engine.errors import ConfigError
from dlm_engine.strategies._block_diffusion import (BlockDiffusionError, BlockDiffusionStrategy, quiet_plan, top_k_filter,
                                         top_p_filter)


class SdarSampler(str, Enum):
    eval = "eval"            # evaluation/opencompass huggingface_bd3.block_diffusion_generate
    generate = "generate"    # generate.py block_diffusion_generate


EVAL_REMASKING = ("low_confidence", "random")
GENERATE_REMASKING = ("low_confidence_static", "low_confidence_dynamic", "sequential")


@dataclass
class SdarConfig:
    sampler: SdarSampler = SdarSampler.eval
    block_length: int = 4
    denoising_steps: int = 4
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    remasking: str = "low_confidence"      # eval: low_confidence | random; generate: low_confidence_static |
                                           # low_confidence_dynamic | sequential
    threshold: float = 1.0                 # eval: < 1 = dynamic; generate: low_confidence_dynamic's threshold
    stop_ids: Optional[List[int]] = None   # checked after every stored block; null = the model's EOS and EOT, [] = never
    overwrite: bool = True                 # generate.py writes fresh samples over non-mask positions it selects


@dataclass(frozen=True)
class SdarState:
    phase: str = "block"       # prefill | block | done
    block: int = 0             # absolute block index
    step: int = 0              # decode steps taken in the block
    masks: int = -1            # masked positions of the block (host; -1 = not read yet)
    stopped: bool = False      # a stop id occurs in the generation (host, read after a store)


def sdar_gen_length(prompt_len: int, gen_length: int, block_length: int) -> int:
    """The canvas' generation length of a reference call: up to the block boundary after ``P + G``."""
    B = int(block_length)
    return -(-(prompt_len + gen_length) // B) * B - prompt_len


@register_strategy("sdar", SdarConfig)
class Sdar(BlockDiffusionStrategy):
    def validate(self) -> None:
        c = self.cfg
        self.check_positive("block_length", c.block_length)
        self.check_positive("denoising_steps", c.denoising_steps)
        if not c.temperature > 0:
            raise ConfigError(f"strategy.temperature={c.temperature} must be > 0 (SDAR has no greedy mode: use "
                              "temperature=1 top_k=1; the reference divides by the temperature)")
        if c.top_k is None or c.top_k < 0:
            raise ConfigError(f"strategy.top_k={c.top_k} must be >= 0 (0 = off)")
        if not 0 < float(c.top_p) <= 1:
            raise ConfigError(f"strategy.top_p={c.top_p} is outside (0, 1]")
        B, S = int(c.block_length), int(c.denoising_steps)
        if c.sampler == SdarSampler.eval:
            if c.remasking not in EVAL_REMASKING:
                raise ConfigError(f"strategy.remasking='{c.remasking}' (sampler=eval: choose "
                                  f"{', '.join(EVAL_REMASKING)})")
            if B % S:
                raise ConfigError(f"strategy.block_length={B} is not divisible by strategy.denoising_steps={S} "
                                  "(the evaluation sampler asserts it)")
        elif c.remasking not in GENERATE_REMASKING:
            extra = " (entropy_bounded crashes in the reference)" if c.remasking == "entropy_bounded" else ""
            raise ConfigError(f"strategy.remasking='{c.remasking}' (sampler=generate: choose "
                              f"{', '.join(GENERATE_REMASKING)}){extra}")
        self.schedule = [B // S + (1 if i < B % S else 0) for i in range(S)]

    # -- geometry -------------------------------------------------------------------------------------------
    def _block(self, canvas, b: int):
        B = int(self.cfg.block_length)
        return b * B, min((b + 1) * B, canvas.length)

    def _stop_ids(self, canvas) -> Optional[List[int]]:
        ids = self.cfg.stop_ids
        if ids is None:     # the model's end of sequence and end of turn
            ids = [i for i in (canvas.eos_id, canvas.eot_id) if i is not None]
        return [int(i) for i in ids] or None

    def init_state(self, canvas):
        B = int(self.cfg.block_length)
        first = canvas.gen_start // B
        return SdarState(phase="prefill" if first > 0 else "block", block=first)

    # -- what the next plan must know: the block's masks, and whether a stop id is in the generation ----------
    def reads(self, canvas, st: SdarState):
        if st.phase == "done":
            return None
        s, e = self._block(canvas, st.block)
        masks = canvas.masked_cols(s, max(e, s)).sum(-1)
        ids = self._stop_ids(canvas)
        if ids is None:
            return masks
        gen = canvas.tokens[:, canvas.gen_start:]
        hit = torch.isin(gen, torch.tensor(ids, device=gen.device)).any(-1).to(masks.dtype)
        return [masks, hit]

    def settle(self, canvas, st: SdarState, values, delta):
        if st.phase == "done":
            return st
        masks = int(values[0])
        stopped = bool(values[1]) if len(values) > 1 else False
        return evolve(st, masks=masks, stopped=stopped)

    # -- plans ----------------------------------------------------------------------------------------------
    def plan(self, canvas, st: SdarState):
        c = self.cfg
        B = int(c.block_length)
        if st.phase == "done" or (st.step == 0 and st.stopped):
            return None, st
        if st.phase == "prefill":
            F = (canvas.gen_start // B) * B
            return quiet_plan(0, F, (F, F), (0, F), B), st
        s, e = self._block(canvas, st.block)
        if s >= canvas.length:
            return None, evolve(st, phase="done")
        if st.masks == 0:                      # the block is complete: its store forward
            return quiet_plan(s, e, (e, e), (s, e), B, block_start=st.step == 0), st
        if st.step >= len(self.schedule):
            raise BlockDiffusionError(f"strategy=sdar: block {st.block} still has {st.masks} mask(s) after "
                                      f"denoising_steps={c.denoising_steps} steps (a sampled <MASK> was committed; "
                                      "the reference raises IndexError here)")
        return StepPlan(window=(s, e), sample=False,
                        cache=CacheDirective(block=(s, e), block_start=st.step == 0, step_in_block=st.step,
                                             attention_block=B)), st

    # -- steps ----------------------------------------------------------------------------------------------
    def select(self, canvas, plan, proposal, st: SdarState):
        d = plan.cache
        s, e = d.block
        if st.phase == "prefill":
            return self._quiet(canvas, proposal, s), evolve(st, phase="block", masks=-1)
        if d.store:                             # the store forward: nothing is written
            delta = self._quiet(canvas, proposal, s)
            # the decode ends after this forward when it stored the last block or a stop id is in the generation:
            # the row is finished here (the store forward is one of its forwards)
            if e >= canvas.length:
                delta.finished = ~canvas.finished
            else:
                ids = self._stop_ids(canvas)
                if ids is not None:
                    gen = canvas.tokens[:, canvas.gen_start:]
                    delta.finished = torch.isin(gen, torch.tensor(ids, device=gen.device)).any(-1) & ~canvas.finished
            delta.block_events = [BlockEvent("completed", st.block, s, e), BlockEvent("stored", st.block, s, e)]
            return delta, SdarState(phase="block", block=st.block + 1, step=0, masks=-1)
        delta = self._decode_step(canvas, proposal, s, e, st)
        if st.step == 0:
            delta.block_events.insert(0, BlockEvent("opened", st.block, s, e))
        return delta, evolve(st, step=st.step + 1, masks=-1)

    def _quiet(self, canvas, proposal, s):
        z = torch.zeros((canvas.batch_size, 0), dtype=torch.bool, device=canvas.device)
        return self.delta(canvas, proposal, z, tokens=torch.zeros_like(z, dtype=torch.long), finished=canvas.no_rows())

    def _decode_step(self, canvas, proposal, s: int, e: int, st: SdarState):
        c = self.cfg
        M = canvas.mask_id
        logits = proposal.logits                               # [1, W, V] (model dtype)
        W, V = logits.shape[1], logits.shape[2]
        cur = canvas.tokens[:, s:e]
        masked = cur == M
        n_k = self.schedule[st.step]
        T = float(c.temperature)
        if c.sampler == SdarSampler.eval:
            noise = torch.rand_like(logits, dtype=torch.float64)          # the unused Gumbel draw, always made
            if c.remasking == "random":
                g = logits.to(torch.float64).exp() / (-torch.log(noise)) ** T
                x0 = g.argmax(dim=-1)
                p = torch.rand((x0.shape[0], x0.shape[1]))
            else:
                scaled = logits / T if T != 1 else logits
                p_full = torch.softmax(scaled, dim=-1)
                probs = torch.softmax(top_p_filter(top_k_filter(scaled, c.top_k), c.top_p), dim=-1)
                x0 = torch.multinomial(probs.reshape(-1, V), 1).view(1, W)
                p = p_full.gather(-1, x0[..., None]).squeeze(-1)
            x0 = torch.where(masked, x0, cur)
        else:
            scaled = logits / T if T != 1 else logits
            probs = torch.softmax(top_p_filter(top_k_filter(scaled, c.top_k), c.top_p), dim=-1)
            x0 = torch.multinomial(probs.reshape(-1, V), 1).view(1, W)
            p = probs.gather(-1, x0[..., None]).squeeze(-1)
        # in the probabilities' dtype (the logits'), as the reference ranks them: torch.topk's order of equal values
        # is the reference's only on the same tensor
        conf = torch.where(masked, p, torch.full_like(p, float("-inf")))
        transfer = self._transfer(conf, masked, n_k, W)
        if c.sampler == SdarSampler.generate and not c.overwrite:
            transfer &= masked
        new = torch.where(transfer, x0, cur)
        remask = transfer & (new == M)
        commit = transfer & (new != cur) & (new != M)
        delta = self.delta(canvas, proposal, commit, tokens=new, remask=remask, confidence=conf,
                           finished=canvas.no_rows())
        delta.scalars["block"] = st.block
        return delta

    def _transfer(self, conf: torch.Tensor, masked: torch.Tensor, n_k: int, W: int) -> torch.Tensor:
        c = self.cfg
        k = min(n_k, W)
        if c.sampler == SdarSampler.generate and c.remasking == "sequential":
            first = int(masked[0].to(torch.int8).argmax()) if bool(masked.any()) else W
            out = torch.zeros_like(masked)
            out[:, first:min(first + n_k, W)] = True
            return out
        dynamic = (c.sampler == SdarSampler.eval and float(c.threshold) < 1) or \
                  (c.sampler == SdarSampler.generate and c.remasking == "low_confidence_dynamic")
        if dynamic:
            over = conf > float(c.threshold)
            if int(over.sum()) >= n_k:
                return over
        out = torch.zeros_like(masked)
        if k > 0:
            # per row, on the row's 1-D tensor: equal values (all -inf, generate.py's all-1.0 confidences) are
            # ordered by torch.topk's CPU order, as in the reference
            for r in range(conf.shape[0]):
                out[r, torch.topk(conf[r], k).indices] = True
        return out
