"""``dmax``: DMax's soft parallel decoding, written from ``shared/specs/edit_decoding.md`` section 3 (dInfer's
``decode_uniform``, cross-checked with Diffulex's ``LLaDA2DMaxSampler``).

Blocks as ``llada2``/``edit`` (aligned to column 0; the first decoded block holds the prompt's end). A block's
*active* positions are the ones masked when it starts (never prompt tokens). Each step of a block:

1. ``x = argmax`` of the block's logits (the mask token is not excluded unless ``rm_mask``), ``p`` its float32
   softmax probability.
2. **M2T, a confident left-to-right prefix**: the masked positions before the first masked one with
   ``p < threshold`` are committed; when that first one is the leftmost mask, it alone is committed (whatever its
   confidence). Confident masks after it wait.
3. **Re-decode**: every active position written before the step gets ``x`` again, unconditionally (a write of
   the step; ``edits`` counts the ones whose token changed). An argmax of the mask token re-masks it.
4. The block ends when every active position has ``p >= stop_confidence`` (0.9, dInfer's hard-coded constant)
   or the step changed nothing -- and no mask is left in it. After ``max_block_steps`` forwards (default: the
   block length, as dInfer) the remaining masks get their best non-mask token and the block ends.
5. Otherwise the next forward takes **soft inputs** at the active written positions: the mixture of the embedding
   of ``x`` (weight ``p``) and the mask embedding (weight ``1 - p``), rescaled to ``p |E[x]| + (1 - p) |E[m]|``
   (:class:`dlm_engine.core.protocol.SoftInputs`; ``soft_top_k > 1`` mixes the top-k tokens of the softmax).
   Prompt tokens and masks keep their plain embeddings; the block's first forward takes token ids only.

The model is told only the columns, tokens and weights (``CallRequest.soft``): every bundled family embeds them
(``Cap.SOFT_INPUTS``); a model that does not offer them is refused before decoding. Output differences from
dInfer, by design of this engine: a mask is never returned as text (dInfer can leave masks when a block stops on
``threshold > 0.9`` or on a mask argmax: here the block goes on until none is left); a block with no mask at its
start is skipped without a forward; the answer is cut at the first EOS (dInfer drops EOS ids and keeps the rest).
``mix: diffulex`` blends in the embedding dtype as Diffulex's ``dmax_topk`` merge (the spec leaves open which of
the two DMax's own code does; dInfer's float32 form is the default).

Caches: every column of the block is recomputed each step (``BLOCK_LOGITS``) and finished blocks are stored by
the next block's first forward, over their final tokens; so on block-causal models (LLaDA2.x, Fast-dLLM v2, SDAR)
``prefix``, ``dual`` and ``block_store`` decode as ``none`` does (tests/test_dmax.py; ``dllm`` too with ``kp=kr=1``),
and on bidirectional ones (LLaDA, Dream) they are the usual approximations (exact refreshed at every step). ``d2cache`` (query-set
columns only) and ``block_kv`` (the references' store forwards) are refused by capability.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.protocol import SOFT_MIXES, SoftInputs
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.strategy import evolve
from dlm_engine.errors import ConfigError
from dlm_engine.strategies.llada2 import AbsoluteBlocks


@dataclass
class DMaxConfig:
    block_length: int = 32               # block size of the schedule (DMax scripts: 32)
    threshold: float = 0.5               # M2T prefix threshold (DMax scripts: 0.5 math, 0.65 code)
    stop_confidence: float = 0.9         # a block ends when every active position is this confident (dInfer: 0.9)
    soft_top_k: int = 1                  # tokens mixed into a soft input (dInfer: 1)
    mix: str = "dinfer"                  # dinfer (float32 blend) | diffulex (blend in the embedding dtype)
    max_block_steps: Optional[int] = None   # forwards per block at most (null = block_length, as dInfer)
    rm_mask: bool = False                # exclude the mask token from the argmax (dInfer's unused flag)
    eos_early_stop: bool = True          # stop after a block once the generation holds an EOS (DMax scripts)
    eos_search: str = "generation"       # (AbsoluteBlocks' key; dmax searches the generated part)
    temperature: float = 0.0             # greedy only (AbsoluteBlocks' key; another value is refused)
    top_k: Optional[int] = None          # (unused: greedy)
    top_p: Optional[float] = None        # (unused: greedy)


@dataclass(frozen=True)
class DMaxState:
    block: int = -1
    first: int = 0
    step: int = 0                        # forwards spent in the block
    counts: Tuple[int, ...] = ()
    eos_blocks: Tuple[int, ...] = ()
    active: Optional[torch.Tensor] = None    # [W] bool: the block's positions masked at its start
    soft: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None   # (where [W], tokens [W,K], probs [W,K])
    ended: Optional[torch.Tensor] = None     # [1] (device): the step ended the block (told by its confidences)
    done: bool = False


@register_strategy("dmax", DMaxConfig)
class DMax(AbsoluteBlocks):
    needs = caps(Cap.BLOCK_LOGITS)           # every column of the block, recomputed each step
    model_needs = caps(Cap.SOFT_INPUTS)      # the model embeds the soft inputs (CallRequest.soft)

    def validate(self) -> None:
        super().validate()
        c = self.cfg
        self.check_unit_interval("stop_confidence", c.stop_confidence)
        self.check_positive("soft_top_k", c.soft_top_k)
        if c.mix not in SOFT_MIXES:
            raise ConfigError(f"strategy.mix='{c.mix}' (choose {', '.join(SOFT_MIXES)})")
        if float(c.temperature) != 0.0:
            raise ConfigError(f"strategy.temperature={c.temperature}: dmax decodes greedily (set 0)")
        if c.max_block_steps is not None:
            self.check_positive("max_block_steps", c.max_block_steps)
        self.cap = int(c.max_block_steps) if c.max_block_steps is not None else self.bl

    def max_steps(self, canvas) -> int:
        return self.n_blocks(canvas) * (self.cap + 1) + 64

    def init_state(self, canvas):
        return DMaxState(first=self.first_block(canvas))

    def step_facts(self, canvas, st: DMaxState) -> list:
        """Whether the step ended the block: its rule reads the step's confidences, which the canvas does not hold,
        so ``select`` leaves the flag on the device (``st.ended``) and it is read with the block facts."""
        return [] if st.ended is None else [st.ended]

    def settle(self, canvas, st: DMaxState, values, delta):
        st, rest = self.with_facts(canvas, st, values)
        st = evolve(st, ended=None)
        if delta is None:
            return evolve(st, block=st.first, step=0)
        if rest and rest[0]:
            return self.end_block(canvas, st, delta)
        return evolve(st, step=st.step + 1)

    def end_block(self, canvas, st: DMaxState, delta=None) -> DMaxState:
        b = st.block
        if delta is not None:
            s, e = self.bounds(canvas, b)
            delta.block_events.append(BlockEvent("completed", b - st.first, max(s, canvas.gen_start), e))
        st = evolve(st, active=None, soft=None)
        if self.cfg.eos_early_stop and self.eos_in_generation(st, b):
            return evolve(st, done=True)
        if b + 1 >= self.n_blocks(canvas):
            return evolve(st, done=True)
        return evolve(st, block=b + 1, step=0)

    def plan(self, canvas, st: DMaxState):
        while not st.done and st.step == 0 and st.counts[st.block] == 0:    # no mask in the block: no forward
            if self.cfg.eos_early_stop and self.eos_in_generation(st, st.block):
                st = evolve(st, done=True)
            elif st.block + 1 >= self.n_blocks(canvas):
                st = evolve(st, done=True)
            else:
                st = evolve(st, block=st.block + 1)
        if st.done:
            return None, st
        store = [self.bounds(canvas, st.block - 1)] if st.step == 0 and st.block > st.first else []
        plan = self.plan_step(canvas, st, store)
        if st.step > 0 and st.soft is not None:
            plan.soft = self.soft_inputs(canvas, plan.window, st.soft)
        return plan, st

    @staticmethod
    def soft_inputs(canvas, window, soft) -> SoftInputs:
        """The block's soft inputs placed on the canvas (one row)."""
        s, e = window
        where, tok, prob = soft
        L, K = canvas.length, tok.shape[-1]
        w = torch.zeros((1, L), dtype=torch.bool, device=canvas.device)
        t = torch.zeros((1, L, K), dtype=torch.long, device=canvas.device)
        p = torch.zeros((1, L, K), dtype=torch.float32, device=canvas.device)
        w[0, s:e], t[0, s:e], p[0, s:e] = where, tok, prob
        return SoftInputs(w, t, p, int(canvas.mask_id))

    def select(self, canvas, plan, proposal, st: DMaxState):
        c = self.cfg
        s, e = plan.window
        m = int(canvas.mask_id)
        logits = proposal.logits[0]                                  # [W, V] in the model's dtype
        without_mask = logits.float().index_fill(-1, torch.tensor([m], device=logits.device), float("-inf"))
        lf = without_mask if c.rm_mask else logits.float()
        x = (lf if c.rm_mask else logits).argmax(-1)                 # on the raw logits (lowest id among ties)
        p = (lf.gather(-1, x[:, None]).squeeze(-1) - lf.logsumexp(-1)).exp()   # float32 confidence of x
        x_nm = without_mask.argmax(-1)                               # the best non-mask token (forced commits)

        tok = canvas.tokens[0, s:e]
        masked = canvas.step_of[0, s:e] < 0
        active = masked if st.step == 0 else st.active
        forced = st.step + 1 >= self.cap                             # the block's last allowed forward

        # M2T: the masked positions before the first unconfident one; else the leftmost mask alone
        before = (masked & (p < float(c.threshold))).long().cumsum(0) == 0
        prefix = masked & before
        leftmost = masked & (masked.long().cumsum(0) == 1)
        m2t = masked if forced else torch.where(prefix.any(), prefix, leftmost)
        is_m = x == m
        new = torch.where(is_m, x_nm, x) if forced else x
        m2t = m2t & (new != m)                                       # an argmax of the mask leaves it masked
        # re-decode: every active position written before the step, unconditionally
        redo = active & ~masked
        remask = redo & (new == m)
        rewrite = redo & ~remask
        commit = m2t | rewrite
        edits = rewrite & (new != tok)
        changed = m2t.any() | edits.any() | remask.any()
        confident = (~active | (p >= float(c.stop_confidence))).all()
        left = (masked & ~m2t) | remask
        block_end = (confident | ~changed) & ~left.any()
        if forced:
            block_end = torch.ones((), dtype=torch.bool, device=canvas.device)

        # the next forward's soft inputs: active positions holding a token after the writes
        K = int(c.soft_top_k)
        where = active & ~left
        if K == 1:
            stok, sprob = new[:, None], p[:, None]
        else:
            probs = torch.softmax(lf, dim=-1)
            sprob, stok = probs.topk(K, dim=-1)
        soft = (where, stok, sprob)

        last = torch.tensor(st.block + 1 >= self.n_blocks(canvas), device=canvas.device)
        stop = last
        if c.eos_early_stop:
            stop = stop | self.eos_written(canvas, commit, new, s, e)
        events = [BlockEvent("opened", st.block - st.first, max(s, canvas.gen_start), e)] if st.step == 0 else []
        delta = self.delta(canvas, proposal, commit[None], tokens=new[None], confidence=p[None],
                           remask=remask[None], events=events, finished=(block_end & stop)[None],
                           scalars={"block": st.block, "committed": m2t.sum()[None], "edits": (edits | remask).sum()[None],
                                    "redecoded": redo.sum()[None]})
        return delta, evolve(st, active=active, soft=soft, ended=block_end.long()[None])


__all__ = ["DMaxConfig", "DMax"]
