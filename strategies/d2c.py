"""``d2c``: the d2Cache framework's per-step decoding (its ``vanilla`` generation; docs/specs/d2cache.md §3-§6).

Blocks of ``block_length`` are decoded in order. Every step runs the rows that still have a masked position in
the current block (a row whose block is done sits the step out; a block with no such row ends without a
forward), samples *every* generated position of those rows with the shared :func:`sample_tokens` (temperature,
top-p/top-k, PC-Sampler ``debias``, confidence kind ``alg``), optionally multiplies the confidences by the
certainty prior (``sigma``) and commits, per row, at least ``num_transfer_tokens`` of the block's masked positions:

* no rule: exactly ``min(num_transfer_tokens, masked left)`` top-scored positions (a fixed rate, no ``steps``);
* ``threshold``: every position scoring ``>= threshold`` (at least ``num_transfer_tokens``);
* ``factor``: d2Cache's factor rule (``max(n - 1, num_transfer_tokens)`` tokens);
* ``gamma``: EB-Sampler's entropy budget.

Presets: ``pc_sampler`` (debias), ``eb_sampler`` (gamma), ``certainty_prior`` (sigma). :mod:`strategies.klass`
and :mod:`strategies.ar` reuse this loop with their own selection. The registered class adds the fast layer's
:class:`~dlm_engine.core.fast.block_scored.BlockScored`: it samples only the block's candidates where that gives the
same bits.

Reference quirks are reproduced by default; each has an option for the corrected behaviour
(``restrict_to_computed_logits``, ``eb_cummax_over_ranks``, ``debias_after_alg``, ``filters_at_zero_temperature``,
``reference_positions``, ``sample_candidates_only``, ``eos_fill``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from dlm_engine.core.blockwise import block_counts, host_rows
from dlm_engine.core.canvas import FrameDelta
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.confidence import Confidence, check_kind, sampler_confidence
from dlm_engine.core.eos import stop_at_eos
from dlm_engine.core.priors import CertaintyDensity, FrequencyTable, FrequencyWeights
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.rows import full_batch
from dlm_engine.core.sampler import ALGS, Sampled, sample_tokens
from dlm_engine.core.selection import d2c_commit, first_true
from dlm_engine.core.fast.block_scored import BlockScored
from dlm_engine.core.strategy import CacheDirective, StepPlan, Strategy, evolve, masked_after
from dlm_engine.errors import ConfigError


@dataclass
class D2CConfig:
    preset: Optional[str] = None                # the preset that chose these settings (pc_sampler, eb_sampler,
                                                # certainty_prior): how tables, plots and messages name the run
    block_length: Optional[int] = None          # null = gen_length (one block)
    num_transfer_tokens: int = 1                # tokens committed per step (at least, with a rule)
    threshold: Optional[float] = None           # commit every masked position scoring >= threshold
    factor: Optional[float] = None              # d2Cache's factor rule
    gamma: Optional[float] = None               # EB-Sampler entropy budget
    alg: Confidence = Confidence.maskgit_plus   # maskgit_plus = prob | topk_margin = margin | entropy (sum p ln p) | random
    temperature: float = 0.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    debias: bool = False                        # PC-Sampler: confidence * -ln(corpus frequency), clipped
    clip_alpha: Optional[float] = None          # PC-Sampler clip (null = 10)
    freq_table: str = "auto"                    # auto (by model family) | llada | dream | path to a JSON table
    sigma: Optional[float] = None               # certainty prior width (null/0 = off)
    stop_until_eos: bool = False                # positions after a row's first decoded EOS are not decoded
    # corrected behaviours (the defaults reproduce the reference)
    restrict_to_computed_logits: bool = False   # quirk 1: positions a cache did not compute stay candidates (1/V)
    eb_cummax_over_ranks: bool = False          # quirk 7: EB's running maximum runs over the batch
    debias_after_alg: bool = False              # quirk 8: alg overwrites the debiased confidence
    filters_at_zero_temperature: bool = True    # quirk 16: top-p/top-k reshape confidences at T = 0 too
    reference_positions: bool = True           # quirk 12: Dream rows ignore left padding for positions
    sample_candidates_only: bool = False        # quirk 15: every generated position is sampled (RNG)
    eos_fill: bool = False                      # quirk 19: masks after the first EOS stay (True: filled with EOS)


@dataclass(frozen=True)
class D2CPlan:
    """The eligible positions of the block per row that takes part in the step (host)."""

    counts: Sequence[int]


@dataclass(frozen=True)
class BlockState:
    block: int = 0
    step: int = 0                               # steps taken in the current block
    freq: Optional[FrequencyWeights] = None     # PC-Sampler table's weights (length V), loaded on the first step
    counts: Tuple[Tuple[int, ...], ...] = ()    # eligible positions per row and block, counted on the canvas
    density: Optional[CertaintyDensity] = None  # the certainty prior's reused rows (sigma set), one per decode


class D2CRule(Strategy):
    """The d2c rule (registered as :class:`D2C`, with its fast layer)."""

    offers = caps(Cap.BLOCKS)
    needs = caps()                              # positions without logits are uniform (or skipped) by design

    def validate(self) -> None:
        c = self.cfg
        self.block_len = self.block_length_or_gen(c.block_length)
        self.num_blocks = self.gen_length // self.block_len
        self.check_positive("num_transfer_tokens", c.num_transfer_tokens)
        rules = [k for k in ("threshold", "factor", "gamma") if getattr(c, k) is not None]
        if len(rules) > 1:
            raise ConfigError(f"strategy: set at most one of threshold, factor and gamma (got {', '.join(rules)})")
        if c.clip_alpha is not None and not float(c.clip_alpha) > 0:
            raise ConfigError(f"strategy.clip_alpha={c.clip_alpha} must be > 0")
        # the confidence kind in use sets which thresholds mean something: PC-Sampler's debiased scores go up to
        # clip_alpha, an entropy is <= 0 (docs/thresholds.md)
        check_kind("alg", c.alg, ALGS)
        self.confidence_kind = sampler_confidence(c.alg, c.debias, c.clip_alpha, c.debias_after_alg)
        self.check_threshold("threshold", c.threshold, self.confidence_kind, allow_none=True)
        for key in ("factor", "gamma"):
            if getattr(c, key) is not None and not float(getattr(c, key)) > 0:
                raise ConfigError(f"strategy.{key}={getattr(c, key)} must be > 0")
        self.check_non_negative("temperature", c.temperature)
        if c.top_p is not None and not 0.0 < float(c.top_p) <= 1.0:
            raise ConfigError(f"strategy.top_p={c.top_p} is outside (0, 1]")
        if c.top_k is not None:
            self.check_positive("top_k", c.top_k)
        if c.sigma is not None:
            self.check_non_negative("sigma", c.sigma)

    # -- set-up ------------------------------------------------------------------------------------------
    def init_state(self, canvas) -> BlockState:
        c = self.cfg
        if (c.stop_until_eos or c.eos_fill) and canvas.eos_id is None:
            raise ConfigError("strategy.stop_until_eos needs the model's eos_token_id, which this model does not define")
        if c.debias:   # fail before the first forward when the table cannot be found
            FrequencyTable.resolve(c.freq_table, canvas.model_info.model_type)
        return BlockState(density=CertaintyDensity(c.sigma) if c.sigma else None)

    def frequencies(self, canvas, st: BlockState, vocab: int) -> BlockState:
        """The state with the PC-Sampler table of the model's vocabulary (loaded on the first step)."""
        if not self.cfg.debias or st.freq is not None:
            return st
        path = FrequencyTable.resolve(self.cfg.freq_table, canvas.model_info.model_type)
        return evolve(st, freq=FrequencyTable.weights(str(path), vocab))

    # -- helpers -----------------------------------------------------------------------------------------
    def eligible(self, canvas, masked: torch.Tensor, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B, G]`` generated positions a step may decode: masked, and before the row's first decoded EOS
        with ``stop_until_eos`` (``tokens``: the generation's tokens, default the canvas')."""
        if not self.cfg.stop_until_eos:
            return masked
        gen = canvas.tokens[:, canvas.gen_start:] if tokens is None else tokens
        is_eos = (gen == canvas.eos_id) & ~masked
        G = gen.shape[1]
        col = torch.arange(G, device=gen.device)
        first = first_true(is_eos, G)
        return masked & (col[None, :] < first[:, None])

    def after(self, canvas, delta: FrameDelta) -> torch.Tensor:
        """Eligible positions once ``delta`` (over the generation) is applied."""
        masked = masked_after(canvas, delta.start, delta.commit, delta.remask)
        if not self.cfg.stop_until_eos:
            return masked
        tokens = torch.where(delta.commit, delta.tokens, canvas.tokens[:, canvas.gen_start:])
        return self.eligible(canvas, masked, tokens)

    def block_cols(self, block: int):
        return block * self.block_len, (block + 1) * self.block_len

    def positions(self, canvas) -> Optional[torch.Tensor]:
        """The reference's Dream copy numbers positions 0..L-1 whatever the padding (quirk 12)."""
        if self.cfg.reference_positions and canvas.model_info.logits_shift and canvas.is_padded:
            return torch.arange(canvas.length, device=canvas.device).expand(canvas.batch_size, -1)
        return None

    # -- plan / select -----------------------------------------------------------------------------------
    def plan(self, canvas, st: BlockState):
        g = canvas.gen_start
        while st.block < self.num_blocks:
            left = [row[st.block] for row in st.counts]      # eligible positions per row (last host read)
            if any(left):
                break
            st = evolve(st, block=st.block + 1, step=0)
        else:
            return None, st
        a, b = self.block_cols(st.block)
        d = CacheDirective(block=(g + a, g + b), block_start=st.step == 0, step_in_block=st.step)
        return StepPlan(window=(g, canvas.length), sample=False, rows=None if all(left) else [n > 0 for n in left],
                        cache=d, temperature=self.cfg.temperature, position_ids=self.positions(canvas),
                        data=D2CPlan([n for n in left if n > 0])), st

    # -- what the next plan must know: eligible positions per row and block ---------------------------------
    def reads(self, canvas, st: BlockState):
        elig = self.eligible(canvas, canvas.masked_cols(canvas.gen_start)) & ~canvas.finished[:, None]
        return block_counts(canvas, self.block_len, elig)

    def settle(self, canvas, st: BlockState, values, delta):
        counts = host_rows(values, canvas.batch_size)
        if delta is not None and st.block < self.num_blocks and not any(row[st.block] for row in counts):
            return evolve(st, block=st.block + 1, step=0, counts=counts)     # the step finished the block
        return evolve(st, counts=counts)

    # -- sampling --------------------------------------------------------------------------------------------
    def sampler_options(self, st: BlockState) -> dict:
        """The keyword arguments of :func:`sample_tokens` for this config (and the loaded PC-Sampler table)."""
        c = self.cfg
        return dict(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, alg=c.alg.value, freq=st.freq,
                    clip_alpha=c.clip_alpha, debias_after_alg=c.debias_after_alg,
                    filters_at_zero=c.filters_at_zero_temperature)

    def sample(self, proposal, cand, block_cand, counts, st: BlockState) -> Sampled:
        """The step's proposals at every generated position of the call's rows (the reference samples them all,
        quirk 15), or at the candidates ``cand`` only (``sample_candidates_only``). ``block_cand`` and ``counts``
        (the block's candidates, and their number per call row when known on the host) are for the fast layer
        (:mod:`dlm_engine.core.fast.block_scored`)."""
        logits, kw = proposal.logits, self.sampler_options(st)
        if not self.cfg.sample_candidates_only:
            return sample_tokens(logits, **kw)
        part = sample_tokens(logits[cand], **kw)
        conf = torch.full(cand.shape, float("-inf"), dtype=part.confidence.dtype, device=logits.device)
        x0 = torch.zeros(cand.shape, dtype=torch.long, device=logits.device)
        probs = torch.zeros(cand.shape + logits.shape[-1:], dtype=part.probs.dtype, device=logits.device)
        conf[cand], x0[cand], probs[cand] = part.confidence, part.x0, part.probs
        return Sampled(conf, x0, probs)

    # -- select ----------------------------------------------------------------------------------------------
    def pick(self, scores, cand, block_cand, sampled: Sampled, st: BlockState, rows, counts):
        """``[B_a, G]`` commits of the call's rows (``rows``; None: every row) and the new state (subclasses: KLASS,
        AR): at least ``num_transfer_tokens`` of the block's candidates ``block_cand`` by the config's rule.
        ``counts``: the block's candidates per call row when known on the host (None when a cache may have left
        some out)."""
        c = self.cfg
        commit = d2c_commit(scores, block_cand, c.num_transfer_tokens, counts=counts, threshold=c.threshold,
                            factor=c.factor, gamma=c.gamma, probs=sampled.probs, eb_over_ranks=c.eb_cummax_over_ranks)
        return commit, st

    def in_block(self, cand: torch.Tensor, block: int) -> torch.Tensor:
        """``cand`` within the columns of ``block`` (False elsewhere)."""
        a, b = self.block_cols(block)
        out = torch.zeros_like(cand)
        out[:, a:b] = cand[:, a:b]
        return out

    def select(self, canvas, plan, proposal, st: BlockState):
        c = self.cfg
        rows = proposal.rows                             # None: the call ran every row
        masked_all = canvas.masked_cols(canvas.gen_start)
        masked = masked_all if rows is None else masked_all[rows]
        # the candidates: masked positions (with restrict_to_computed_logits, those a cache computed logits for)
        cand = masked if (proposal.valid is None or not c.restrict_to_computed_logits) else masked & proposal.valid
        st = self.frequencies(canvas, st, proposal.logits.shape[-1])
        block_cand = self.in_block(cand, st.block)
        if c.stop_until_eos:
            elig = self.eligible(canvas, masked_all)
            block_cand = block_cand & (elig if rows is None else elig[rows])
        counts = plan.data.counts if cand is masked else None      # the block's candidates, counted on the host
        sampled = self.sample(proposal, cand, block_cand, counts, st)
        conf = torch.where(cand, sampled.confidence, float("-inf"))
        scores = conf * st.density.of_masked(masked) if c.sigma else conf      # the certainty prior
        commit, st = self.pick(scores, cand, block_cand, sampled, st, rows, counts)
        delta = self.frame(canvas, rows, commit, sampled.x0, conf)
        delta.scalars.update(block=st.block, committed=delta.commit.sum(-1))
        return delta, evolve(st, step=st.step + 1)      # the block ends in settle, once its positions are counted

    def frame(self, canvas, rows, commit_a, x0_a, conf_a) -> FrameDelta:
        """The full-batch delta over the generation from the call rows' commits, tokens and confidences (``rows``
        None: the call ran every row), finishing the rows left with nothing to decode (:meth:`finish`)."""
        g, B, dev = canvas.gen_start, canvas.batch_size, canvas.device
        conf_a = conf_a if conf_a.dtype == torch.float32 else conf_a.float()
        if rows is None:
            commit, active, conf = commit_a, canvas.every_row(), conf_a
            tokens = torch.where(commit_a, x0_a, canvas.cols(g, canvas.length)[0])
        else:
            commit = full_batch(commit_a, rows, B, False)
            tokens = canvas.tokens[:, g:].clone()
            tokens.index_copy_(0, rows, torch.where(commit_a, x0_a, tokens[rows]))
            conf = full_batch(conf_a, rows, B, 0.0)
            active = torch.zeros(B, dtype=torch.bool, device=dev).index_fill_(0, rows, True)
        delta = FrameDelta(step=canvas.step + 1, nfe=1, start=g, commit=commit, tokens=tokens, active=active,
                           finished=torch.zeros(B, dtype=torch.bool, device=dev), confidence=conf)
        return self.finish(canvas, delta)

    def finish(self, canvas, delta: FrameDelta) -> FrameDelta:
        """Mark rows with nothing left to decode finished (with ``eos_fill``, fill what follows an EOS)."""
        if self.cfg.eos_fill:
            delta = stop_at_eos(canvas, delta, canvas.eos_id)
        left = self.after(canvas, delta).any(-1)
        delta.finished = delta.finished | (~left & ~canvas.finished)
        return delta


@register_strategy("d2c", D2CConfig)
class D2C(BlockScored, D2CRule):
    """d2c, sampling only the block's candidates where that gives the same bits (the fast layer's
    :class:`~dlm_engine.core.fast.block_scored.BlockScored`)."""

    block_pick = D2CRule.pick
