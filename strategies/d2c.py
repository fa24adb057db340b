"""``d2c``: the d2Cache framework's per-step decoding (its ``vanilla`` generation; docs/specs/d2cache.md §3-§6).

Blocks of ``block_length`` are decoded in order. Every step runs the rows that still have a masked position in
the current block (a row whose block is done sits the step out; a block with no such row ends without a
forward), samples *every* generated position of those rows with the shared :func:`sample_tokens` (temperature,
top-p/top-k, PC-Sampler ``debias``, confidence kind ``alg``; where that gives the same bits, only the block's
candidates: :meth:`D2C.block_scores_suffice`), optionally multiplies the confidences by the
certainty prior (``sigma``) and commits, per row, at least ``num_transfer_tokens`` of the block's masked positions:

* no rule: exactly ``min(num_transfer_tokens, masked left)`` top-scored positions (a fixed rate, no ``steps``);
* ``threshold``: every position scoring ``>= threshold`` (at least ``num_transfer_tokens``);
* ``factor``: d2Cache's factor rule (``max(n - 1, num_transfer_tokens)`` tokens);
* ``gamma``: EB-Sampler's entropy budget.

Presets: ``pc_sampler`` (debias), ``eb_sampler`` (gamma), ``certainty_prior`` (sigma). :mod:`strategies.klass`
and :mod:`strategies.ar` reuse this loop with their own selection.

Reference quirks are reproduced by default; each has an option for the corrected behaviour
(``restrict_to_computed_logits``, ``eb_cummax_over_ranks``, ``debias_after_alg``, ``filters_at_zero_temperature``,
``reference_positions``, ``sample_candidates_only``, ``eos_fill``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from dlm_engine.core.blockwise import block_counts, counts_after, fresh_block_counts, host_rows
from dlm_engine.core.canvas import FrameDelta
from dlm_engine.core.devices import host_constant
from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.confidence import Confidence, check_kind, sampler_confidence
from dlm_engine.core.eos import stop_at_eos
from dlm_engine.core.priors import CertaintyDensity, FrequencyTable, FrequencyWeights
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.rows import full_batch
from dlm_engine.core import sampler
from dlm_engine.core.sampler import ALGS, Sampled, placed, sample_tokens
from dlm_engine.core.selection import d2c_commit, first_true, masked_order
from dlm_engine.core.fast import finished_before, host_finished
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
    counts: Tuple[Tuple[int, ...], ...] = ()    # last host read: eligible positions per row and block
    # per-step caches (host-keyed, never read across a mismatch): the ``[G]`` columns of block ``blk_of``, and the
    # commits per row ([B]) of the delta of step ``committed_step`` when they were all the eligible positions it
    # changed (see :meth:`D2C.reads_commits`): the host read takes them instead of recounting the canvas
    blk: Optional[torch.Tensor] = None
    blk_of: int = -1
    committed: Optional[torch.Tensor] = None
    committed_step: int = -1
    # the same commits per row known on the host (the fixed rate: :meth:`D2C.host_commits`): nothing is read back
    committed_host: Optional[Tuple[int, ...]] = None
    density: Optional[CertaintyDensity] = None  # the certainty prior's reused rows (sigma set), one per decode
    # (within a step, select -> pick) the scores when they are ``-inf`` exactly where the step's confidences are:
    # the confidences times a density known to be positive (see ranked); None otherwise and between steps
    ranked_scores: Optional[torch.Tensor] = None


class BlockSampled(Sampled):
    """:meth:`D2C.sample_at`'s result: the confidence is ``-inf`` outside the positions sampled (the block's
    candidates)."""


@dataclass
class TailSampled(Sampled):
    """:meth:`D2C.sample` from generated column ``first`` on: before it the confidence is ``-inf`` and the token
    0, and ``probs`` covers columns ``[first, G)`` only."""

    first: int = 0


@register_strategy("d2c", D2CConfig)
class D2C(Strategy):
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

    # -- the step's host read: eligible positions per row and block -----------------------------------------
    @staticmethod
    def reads_commits(canvas, st: BlockState) -> bool:
        """Whether this step's host read is select's commit counts: its delta (of this very step) committed
        eligible positions of the block only and nothing else changed them (no row finished before it, no EOS
        rule), so they update the host counts; otherwise the canvas is recounted."""
        return st.committed is not None and st.committed_step == canvas.step

    @staticmethod
    def knows_commits(canvas, st: BlockState) -> bool:
        """:meth:`reads_commits` with the counts known on the host already (:meth:`host_commits`): no read."""
        return st.committed_host is not None and st.committed_step == canvas.step

    def sync_request(self, canvas, st: BlockState):
        if self.knows_commits(canvas, st):
            return None
        if self.reads_commits(canvas, st):
            return st.committed
        elig = self.eligible(canvas, canvas.masked_cols(canvas.gen_start)) & ~canvas.finished[:, None]
        return block_counts(canvas, self.block_len, elig)

    def fresh_values(self, canvas, st: BlockState):
        # every generated position is eligible on a fresh canvas (no EOS decoded, no row finished)
        return fresh_block_counts(canvas, self.block_len)

    def synced(self, canvas, st: BlockState, values, delta):
        if self.knows_commits(canvas, st):
            counts = counts_after(st.counts, st.block, st.committed_host)
        elif self.reads_commits(canvas, st):
            counts = counts_after(st.counts, st.block, values)
        else:
            counts = host_rows(values, canvas.batch_size)
        if delta is not None and st.block < self.num_blocks and not any(row[st.block] for row in counts):
            # the step finished the block
            return evolve(st, block=st.block + 1, step=0, counts=counts, committed=None, committed_host=None)
        return evolve(st, counts=counts, committed=None, committed_host=None)

    def sampler_options(self, st: BlockState) -> dict:
        """The keyword arguments of :func:`sample_tokens` for this config (and the loaded PC-Sampler table)."""
        c = self.cfg
        return dict(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, alg=c.alg.value, freq=st.freq,
                    clip_alpha=c.clip_alpha, debias_after_alg=c.debias_after_alg,
                    filters_at_zero=c.filters_at_zero_temperature)

    def sample(self, logits: torch.Tensor, cand: torch.Tensor, st: BlockState, first: int = 0) -> Sampled:
        """The step's proposals for every generated position of the call's rows (or only the candidates);
        ``first`` > 0 (see :meth:`sample_from`): from that generated column on (a :class:`TailSampled`)."""
        c = self.cfg
        kw = self.sampler_options(st)
        if first > 0:
            part = sample_tokens(logits[:, first:], **kw)
            B, G = cand.shape
            conf = part.confidence.new_full((B, G), float("-inf"))
            conf[:, first:] = part.confidence
            x0 = part.x0.new_zeros((B, G))
            x0[:, first:] = part.x0
            return TailSampled(conf, x0, part.probs, first)
        if not c.sample_candidates_only:
            return sample_tokens(logits, **kw)
        part = sample_tokens(logits[cand], **kw)
        V = logits.shape[-1]
        conf = torch.full(cand.shape, float("-inf"), dtype=part.confidence.dtype, device=logits.device)
        x0 = torch.zeros(cand.shape, dtype=torch.long, device=logits.device)
        probs = torch.zeros(cand.shape + (V,), dtype=part.probs.dtype, device=logits.device)
        conf[cand], x0[cand], probs[cand] = part.confidence, part.x0, part.probs
        return Sampled(conf, x0, probs)

    # ``pick`` reads the scores of the block's candidates only, and no distribution. Declared by the class that
    # defines ``pick`` (a subclass overriding ``pick`` without saying so samples every position)
    picks_from_block_scores = True

    def block_scores_suffice(self, proposal) -> bool:
        """Whether the step may sample the block's candidates only and get the very bits that sampling every
        generated position (quirk 15) gives there: at ``T = 0`` nothing is drawn (the row-major draw order does
        not matter); ``maskgit_plus`` and ``topk_margin`` are a softmax, a maximum, a top-k and a gather per
        position, which no kernel computes differently for fewer positions (a sum over the vocabulary may: its
        CPU and GPU reductions split differently for few rows, so ``entropy``, EB's entropy budget and top-p's
        cumulative sum keep every position); nothing downstream reads the other positions' confidences
        (``Proposal.all_confidences``); and ``pick`` reads the block's scores only."""
        owner = next(k for k in type(self).__mro__ if "pick" in vars(k))
        return vars(owner).get("picks_from_block_scores", False) and self.per_position_exact(proposal)

    def sample_from(self, st: BlockState, proposal) -> int:
        """The first generated column whose proposal or distribution the step reads when :meth:`pick` needs
        distributions (0: every column, the reference's quirk 15). A subclass may start later where the result is
        the same bits: see :meth:`Klass.sample_from`."""
        return 0

    def per_position_exact(self, proposal) -> bool:
        """Whether sampling fewer positions gives the very bits sampling every generated position gives at the
        positions sampled (see :meth:`block_scores_suffice`, which adds that ``pick`` reads scores only)."""
        c = self.cfg
        return (c.temperature == 0 and c.gamma is None and c.alg in (Confidence.prob, Confidence.margin)
                and (c.top_p is None or c.top_p >= 1) and not proposal.all_confidences)

    def sample_at(self, logits: torch.Tensor, where: torch.Tensor, count: int, st: BlockState) -> Sampled:
        """:meth:`sample` at the ``count`` positions of ``where`` (known on the host: no read); elsewhere the
        confidence is ``-inf`` and the token 0. No distribution is kept."""
        B, G, V = logits.shape
        order = masked_order(where, count)
        part = sample_tokens(logits.reshape(B * G, V).index_select(0, order), **self.sampler_options(st))
        return BlockSampled(placed(part.confidence, order, (B, G), float("-inf")), placed(part.x0, order, (B, G), 0),
                            None)

    def host_commits(self, counts) -> Optional[Tuple[int, ...]]:
        """Per call row, how many positions :meth:`pick` commits when the host knows it (None otherwise): the fixed
        rate (no threshold, factor or EB budget) of this class's own ``pick``, with the block's candidates per call
        row known (``counts``), commits the top ``min(num_transfer_tokens, candidates)`` of each row. Every
        candidate ranks above the ``-inf`` of the other positions: a probability, a margin, an entropy or a uniform
        draw, times a clipped frequency weight or a certainty prior, is never ``-inf`` (a NaN ranks first, and is a
        candidate too), so ``topk`` takes exactly that many candidates."""
        c = self.cfg
        if (counts is None or type(self).pick is not D2C.pick
                or c.threshold is not None or c.factor is not None or c.gamma is not None):
            return None
        k = int(c.num_transfer_tokens)
        return tuple(min(k, int(n)) for n in counts)

    def pick(self, scores, cand, block_cand, sampled: Sampled, st: BlockState, rows, counts):
        """``[B_a, G]`` commits of the call's rows (``rows``; None: every row) and the new state (subclasses: KLASS,
        AR); ``counts``: the
        block's candidates per call row when known on the host (None when a cache may have left some out)."""
        c = self.cfg
        commit = d2c_commit(scores, block_cand, c.num_transfer_tokens, counts=counts, threshold=c.threshold,
                            factor=c.factor, gamma=c.gamma, probs=sampled.probs, eb_over_ranks=c.eb_cummax_over_ranks,
                            ranked=self.ranked(scores, cand, block_cand, sampled, st))
        return commit, st

    @staticmethod
    def ranked(scores, cand, block_cand, sampled: Sampled, st: Optional[BlockState] = None) -> bool:
        """Whether ``scores`` is ``-inf`` outside ``block_cand`` already, so that a rule ranks it as it is (no
        masking op): they are the step's confidences (:meth:`select` leaves them ``-inf`` outside ``cand``) or
        those times a positive certainty prior (``st.ranked_scores``: ``-inf`` at the same places), and either the
        block's own samples or the block spans every candidate (``block_cand is cand``)."""
        own = scores is sampled.confidence or (st is not None and scores is st.ranked_scores)
        return own and (isinstance(sampled, BlockSampled) or block_cand is cand)

    def block_mask(self, st: BlockState, G: int, device) -> BlockState:
        """The state holding the ``[G]`` columns of its block (made once per block); None when the block is the
        whole generation (one block: the candidates need no masking)."""
        if st.blk_of == st.block:
            return st
        a, b = self.block_cols(st.block)
        if a == 0 and b >= G:
            return evolve(st, blk=None, blk_of=st.block)
        blk = torch.zeros(G, dtype=torch.bool, device=device)
        blk[a:b].fill_(True)
        return evolve(st, blk=blk, blk_of=st.block)

    def select(self, canvas, plan, proposal, st: BlockState):
        c = self.cfg
        rows = proposal.rows                             # None: the call ran every row (no gathers and scatters)
        every = rows is None
        masked_all = canvas.masked_cols(canvas.gen_start)    # canvas.masked() of the generation
        masked = masked_all if every else masked_all[rows]
        cand = masked if (proposal.valid is None or not c.restrict_to_computed_logits) else masked & proposal.valid
        B_a, G, V = proposal.logits.shape
        st = self.block_mask(self.frequencies(canvas, st, V), G, cand.device)
        block_cand = cand if st.blk is None else cand & st.blk      # (not in place below: it may be ``cand``)
        if c.stop_until_eos:
            elig = self.eligible(canvas, masked_all)
            block_cand = block_cand & (elig if every else elig[rows])
        counts = plan.data.counts if cand is masked else None
        n = None if counts is None else sum(counts)
        if (n is not None and sampler.scoring_pays_off(B_a * G - n, V, None, proposal.logits.device)
                and self.block_scores_suffice(proposal)):
            sampled = self.sample_at(proposal.logits, block_cand, n, st)
            conf = sampled.confidence                    # already -inf outside the block's candidates
        else:
            sampled = self.sample(proposal.logits, cand, st, self.sample_from(st, proposal))
            conf = torch.where(cand, sampled.confidence, float("-inf"))
            sampled.confidence = conf                    # (this step's own result) what pick ranks: see ranked
        scores = conf
        if c.sigma:
            scores = conf * st.density.of_masked(masked)
            if st.density.positive:                      # -inf exactly where conf is (and NaN where it is NaN)
                st = evolve(st, ranked_scores=scores)
        commit_a, st = self.pick(scores, cand, block_cand, sampled, st, rows, counts)
        delta, committed, only_commits, n_host = self.frame(canvas, rows, commit_a, sampled.x0, conf, masked_all, st,
                                                            n_call=self.host_commits(counts), run=plan.rows,
                                                            before=finished_before(proposal, canvas.batch_size))
        delta.scalars.update(block=st.block, committed=committed)
        # the block ends in synced, on the host read; ``only_commits`` (the fast path) says the commits were all
        # that changed the eligible positions (``n_host``: and the host knows how many: nothing to read)
        return delta, evolve(st, step=st.step + 1, committed=committed if only_commits and n_host is None else None,
                             committed_host=n_host,
                             committed_step=delta.step, ranked_scores=None)

    def frame(self, canvas, rows, commit_a, x0_a, conf_a, masked: Optional[torch.Tensor] = None,
              st: Optional[BlockState] = None, n_call: Optional[Tuple[int, ...]] = None, run=None,
              before: Optional[Tuple[bool, ...]] = None):
        """``(delta, committed, only_commits, n_host)``: the full-batch delta over the generation from the call rows'
        commits, tokens and confidences (``rows`` None: the call ran every row), its commits per row, and whether
        they were all that changed the eligible positions (``masked``: the generation's masked positions before
        it, given when the fast path may apply; ``st``: the step's state, whose host counts (masked positions per
        row and block then) can tell the finished rows without a reduction; ``n_call``: the commits per call row known
        on the host (:meth:`host_commits`), ``run`` the plan's host flags of the rows that ran (None: every row):
        the fast path then counts and finishes on the host (``delta.finished_host``) and ``n_host`` is those counts
        over the full batch, None otherwise; ``before``: the rows finished before the step, ``Proposal.finished_host``
        -- None: unknown, no fast path)."""
        g, B, dev = canvas.gen_start, canvas.batch_size, canvas.device
        conf_a = conf_a if conf_a.dtype == torch.float32 else conf_a.float()
        if rows is None:
            commit, active = commit_a, canvas.every_row()
            gen = canvas.cols(g, canvas.length)[0]       # (a view of the generation's tokens)
            tokens, conf = torch.where(commit_a, x0_a, gen), conf_a
        else:
            commit = full_batch(commit_a, rows, B, False)
            tokens = canvas.tokens[:, g:].clone()
            tokens.index_copy_(0, rows, torch.where(commit_a, x0_a, tokens[rows]))
            conf = full_batch(conf_a, rows, B, 0.0)
            active = torch.zeros(B, dtype=torch.bool, device=dev).index_fill_(0, rows, True)
        delta = FrameDelta(step=canvas.step + 1, nfe=1, start=g, commit=commit, tokens=tokens, active=active,
                           finished=None, confidence=conf)
        c = self.cfg
        if masked is None or c.eos_fill or c.stop_until_eos or before is None or any(before):
            delta.finished = torch.zeros(B, dtype=torch.bool, device=dev)
            delta = self.finish(canvas, delta)
            return delta, delta.commit.sum(-1), False, None
        # no row was finished before this step, and nothing but the commits changes what is left (no EOS rule):
        # a row finishes when no masked position remains. The commits are masked positions, so a row finishes when
        # it commits as many as it had left (on the host: the eligible ones are the masked ones here)
        left = [sum(row) for row in st.counts] if st is not None else []
        if n_call is not None and len(left) == B:           # counted on the host: no reduction, nothing to read
            if run is None:
                n_host = tuple(n_call)
            else:
                it = iter(n_call)
                n_host = tuple(next(it) if f else 0 for f in run)
            delta.finished_host, delta.finished = host_finished(canvas, n_host, left, before)
            delta.counted = True
            return delta, host_constant(n_host, torch.long, dev), True, n_host
        committed = commit.sum(-1)
        if len(left) == B:                                  # told on the host in the loop's sync
            delta.finished_counts = (committed, tuple(left))
            delta.counted = True
        else:
            delta.finished = ~(masked > commit).any(-1)          # (masked > commit: masked and not committed)
        return delta, committed, True, None

    def finish(self, canvas, delta: FrameDelta) -> FrameDelta:
        """Mark rows with nothing left to decode finished (with ``eos_fill``, fill what follows an EOS)."""
        if self.cfg.eos_fill:
            delta = stop_at_eos(canvas, delta, canvas.eos_id)
        left = self.after(canvas, delta).any(-1)
        delta.finished = delta.finished | (~left & ~canvas.finished)
        return delta
