"""``edit``: LLaDA2.1's decoding with token edits (mask-to-token and token-to-token), written from the SPEC in
``tests/fixtures/bdparity/README.md`` (section ``llada2``, S4).

Blocks as ``llada2`` (aligned to position 0, the model's block-causal blocks). Each step of a block samples every
position of the block (greedy: argmax of the logits, confidence its float32 softmax probability; else temperature,
top-k, top-p and one ``torch.multinomial`` over the block), then writes

* **M2T**: the positions masked at the step's start whose confidence is ``> threshold`` when there are at least
  ``num_to_transfer`` of them, else the ``num_to_transfer`` most confident ones;
* **T2T**: the positions written before the step (generated ones only, never the prompt) whose proposal differs
  from their token with confidence ``> editing_threshold`` -- also while masks remain, so tokens committed earlier
  in the block are rewritten.

Once a block has no mask left, *post-edit* steps follow: a step that edits nothing ends the block, and at most
``max_post_steps`` such steps run (the next one ends the block without a forward). Every write is a commit of the
step (``step_of`` is the last write; edits overwrite). With ``eos_early_stop`` decoding stops after a block when
the generation so far holds an EOS (the search covers the generated part only); without it every block is
decoded (the answer is cut at the first EOS afterwards).

``penalty_lambda`` adds SGLang ``JointThreshold``'s repetition penalty (its step 1):
row ``i >= 1`` of the block loses ``penalty_lambda`` on the token at position ``i - 1`` before the argmax and the
softmax (off by default, as LLaDA2.1).

Batch 1 (as the reference); ``decode_batch`` splits. Caches: edits happen inside the working block only, and
the strategy needs ``block_logits`` (every column of the block recomputed at every step), so a cache never
attends to a stale key/value of an edited column: ``block_store``, ``prefix``, ``dual`` and ``dllm`` decode as
``none`` does (tests/test_edit_caches.py); ``d2cache`` (query-set columns only) is refused by capability.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dlm_engine.core.canvas import BlockEvent
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.strategy import evolve
from dlm_engine.errors import ConfigError
from dlm_engine.strategies.llada2 import AbsoluteBlocks, sample_block


@dataclass
class EditConfig:
    block_length: int = 32               # block size of the schedule and of the model's block-causal mask
    threshold: float = 0.95              # M2T: commit masked positions with confidence > threshold ...
    num_to_transfer: int = 1             # ... when at least this many pass it, else this many most confident
    editing_threshold: float = 0.9       # T2T: rewrite a written position whose proposal differs, above this
    max_post_steps: int = 16             # all-unmasked (post-edit) steps per block at most
    temperature: float = 0.0             # 0 = greedy
    top_k: Optional[int] = None          # sampling only: keep the top-k logits (ties kept)
    top_p: Optional[float] = None        # sampling only: nucleus (the crossing token kept)
    eos_early_stop: bool = False         # stop after a block once the generation holds an EOS
    eos_search: str = "generation"       # (the generated part, as LLaDA2.1; window = LLaDA2.0's search)
    penalty_lambda: float = 0.0          # SGLang JointThreshold's repetition penalty (0 = off, LLaDA2.1): block row i
                                         # loses this on the token at position i - 1 before argmax and softmax
    preset: Optional[str] = None         # the preset that chose these settings (edit_speed, edit_quality): the name
                                         # tables, plots and messages use (decodes the same as without it)


@dataclass(frozen=True)
class EditState:
    block: int = -1
    first: int = 0
    step: int = 0                        # forwards spent in the block
    post: int = 0                        # all-unmasked steps taken in the block
    unmasked_step: bool = False          # the step in flight started with no mask in its block
    counts: Tuple[int, ...] = ()
    eos_blocks: Tuple[int, ...] = ()
    done: bool = False


@register_strategy("edit", EditConfig)
class Edit(AbsoluteBlocks):
    # T2T reads the logits of every written position of the block at every step, and an edit changes a token
    # whose keys/values a cache may hold: the block must be recomputed each step (BLOCK_LOGITS, which every
    # store-based cache gives by recomputing the working block; the blocks before it are final). d2cache, which
    # feeds only a query set and keeps the other columns' keys/values, is refused.
    needs = caps(Cap.BLOCK_LOGITS)

    def validate(self) -> None:
        super().validate()
        c = self.cfg
        self.check_positive("num_to_transfer", c.num_to_transfer)
        if c.editing_threshold is None or not 0.0 <= float(c.editing_threshold) <= 1.0:   # 0: any changed argmax
            raise ConfigError(f"strategy.editing_threshold={c.editing_threshold} is outside [0, 1]")
        self.check_non_negative("penalty_lambda", c.penalty_lambda)
        if c.max_post_steps is None or int(c.max_post_steps) < 0:
            raise ConfigError(f"strategy.max_post_steps={c.max_post_steps} must be >= 0")

    def max_steps(self, canvas) -> int:
        return self.n_blocks(canvas) * (self.bl + int(self.cfg.max_post_steps) + 2) + 64

    def init_state(self, canvas):
        return EditState(first=self.first_block(canvas))

    def step_facts(self, canvas, st: EditState) -> list:
        """The positions the step wrote (a post-edit step writes its edits only)."""
        return [(canvas.step_of[0] == canvas.step).sum()[None]]

    def settle(self, canvas, st: EditState, values, delta):
        st, (written,) = self.with_facts(canvas, st, values)
        if delta is None:
            return evolve(st, block=st.first, step=0, post=0)
        if st.unmasked_step and written == 0:         # a post-edit step that changed nothing ends the block
            return self.end_block(canvas, st, delta)
        return evolve(st, step=st.step + 1)

    def end_block(self, canvas, st: EditState, delta=None) -> EditState:
        b = st.block
        if delta is not None:
            s, e = self.bounds(canvas, b)
            delta.block_events.append(BlockEvent("completed", b - st.first, max(s, canvas.gen_start), e))
        if self.cfg.eos_early_stop and not any(st.counts[st.first:b + 1]) and self.eos_in_generation(st, b):
            return evolve(st, done=True)
        if b + 1 >= self.n_blocks(canvas):
            return evolve(st, done=True)
        return evolve(st, block=b + 1, step=0, post=0)

    def plan(self, canvas, st: EditState):
        while not st.done:
            if st.counts[st.block] == 0:
                if st.post + 1 > int(self.cfg.max_post_steps):      # no forward: the block ends
                    st = self.end_block(canvas, st)
                    continue
                st = evolve(st, post=st.post + 1, unmasked_step=True)
            else:
                st = evolve(st, unmasked_step=False)
            break
        if st.done:
            return None, st
        store = [self.bounds(canvas, st.block - 1)] if st.step == 0 and st.block > st.first else []
        return self.plan_step(canvas, st, store), st

    def select(self, canvas, plan, proposal, st: EditState):
        c = self.cfg
        s, e = plan.window
        logits = proposal.logits[0].float()
        if c.penalty_lambda > 0:
            logits = repetition_penalty(logits, canvas.tokens[0, s:e], float(c.penalty_lambda))
        x0, conf = sample_block(logits, float(c.temperature), c.top_k, c.top_p, greedy_argmax_of_logits=True)
        masked = canvas.step_of[0, s:e] < 0
        old = canvas.tokens[0, s:e]
        n_mask = st.counts[st.block]
        commit = torch.zeros_like(masked)
        if n_mask:                                        # M2T
            conf_m = torch.where(masked, conf, torch.full_like(conf, float("-inf")))
            high = conf_m > float(c.threshold)
            ntt = int(c.num_to_transfer)
            top = torch.zeros_like(high)
            top[torch.topk(conf_m, min(ntt, n_mask)).indices] = True
            commit = torch.where(high.sum() >= ntt, high, top)
        col = torch.arange(s, e, device=canvas.device)
        edit = ~masked & (col >= canvas.gen_start) & (conf > float(c.editing_threshold)) & (x0 != old)   # T2T
        commit = (commit | edit)[None]
        events = [BlockEvent("opened", st.block - st.first, max(s, canvas.gen_start), e)] if st.step == 0 else []
        n_edit = edit.sum()
        # the row is finished when this step ends the decode (no mask left is not the end: post-edit steps follow):
        # a post-edit step that edits nothing or is the last allowed one ends the block, as does filling the block
        # with max_post_steps 0; the decode ends with the block when no block follows or an EOS stop applies
        mps = int(c.max_post_steps)
        if st.unmasked_step:
            block_end = (n_edit == 0) | torch.tensor(st.post >= mps, device=canvas.device)
        else:
            block_end = ~(masked & ~commit[0]).any() & torch.tensor(mps == 0, device=canvas.device)
        stop = torch.tensor(st.block + 1 >= self.n_blocks(canvas), device=canvas.device)
        if c.eos_early_stop:
            stop = stop | self.eos_written(canvas, commit[0], x0, s, e)
        delta = self.delta(canvas, proposal, commit, tokens=x0[None], confidence=conf[None].float(), events=events,
                           finished=(block_end & stop)[None],
                           scalars={"block": st.block, "committed": commit.sum(-1), "edits": n_edit[None],
                                    "post_edit": int(st.unmasked_step)})
        return delta, st


def repetition_penalty(logits: torch.Tensor, block: torch.Tensor, lam: float) -> torch.Tensor:
    """``logits`` ``[W, V]`` of a block whose row ``i >= 1`` loses ``lam`` on the token the block holds at ``i - 1``
    (as the step found it, mask and prompt tokens included); row 0 (its predecessor is in the previous block)
    is left alone. A new tensor."""
    out = logits.clone()
    if out.shape[0] > 1:
        idx = block[:-1, None]
        out[1:].scatter_(1, idx, out[1:].gather(1, idx) - lam)
    return out


__all__ = ["EditConfig", "Edit", "repetition_penalty"]
