"""Fast layer mixins of the d2Cache family (:mod:`strategies.d2c`, ``klass``, ``ar``): sample fewer generated
positions than the reference's sampler, where that gives the same bits at the positions the rule reads.

The reference samples every generated position of a running row every step (quirk 15): a softmax over the whole
vocabulary per position (~126k logits for LLaDA, in float64 under PC-Sampler's debias), although d2c's and AR's
selections read the scores of the current block's candidates only, and KLASS the distributions from the block's
first column on. Sampling fewer positions gives the very bits at those positions when the sampler is per-position
exact (:func:`per_position_exact`): at ``T = 0`` nothing is drawn (the row-major draw order does not matter);
``maskgit_plus`` and ``topk_margin`` are a softmax, a maximum, a top-k and a gather per position, which no kernel
computes differently for fewer positions (a sum over the vocabulary may: its CPU and GPU reductions split differently
for few rows, so ``entropy``, EB's entropy budget and top-p's cumulative sum keep every position); and nothing
downstream reads the other positions' confidences (a cache that does sets ``Proposal.all_confidences``).

The policies' own ``sample`` (the plain rule, what ``decode(..., fast=False)`` runs) samples every generated position.
"""
from __future__ import annotations

from dlm_engine.core import sampler
from dlm_engine.core.confidence import Confidence
from dlm_engine.core.fast.layer import FastLayer
from dlm_engine.core.sampler import Sampled, placed, sample_tokens
from dlm_engine.core.selection import masked_order


def per_position_exact(cfg, proposal) -> bool:
    """Whether sampling fewer positions gives, at those positions, the bits sampling every generated position gives
    (see the module's docstring); ``cfg``: a d2c config."""
    return (cfg.temperature == 0 and cfg.gamma is None and cfg.alg in (Confidence.prob, Confidence.margin)
            and (cfg.top_p is None or cfg.top_p >= 1) and not proposal.all_confidences)


class BlockScored(FastLayer):
    """Samples only the block's candidates (their number per call row known on the host: ``counts``) when the
    policy's ``pick`` is the composed class's ``block_pick`` (a pick that reads the scores of the block's candidates
    and no distribution: d2c's rules but EB, AR's run) and sampling is per-position exact. Saves the softmax over the
    vocabulary at every other generated position of the step (all but the block's candidates: at gen 256 and block
    32, seven eighths of them or more), for a gather of the candidates' logits; taken where the positions left out
    outweigh that gather (:func:`dlm_engine.core.sampler.scoring_pays_off`). The confidences of the positions left
    out are ``-inf`` and their tokens 0: neither is committed nor read."""

    block_pick = None           # the composed class names its policy's pick that reads block scores only

    def block_scores_suffice(self, proposal) -> bool:
        """Whether sampling the block's candidates alone gives the bits the rule reads: the policy's ``pick`` is
        ``block_pick`` (a subclass with its own ``pick`` samples every position) and sampling is per-position exact."""
        return type(self).pick is type(self).block_pick and per_position_exact(self.cfg, proposal)

    def sample(self, proposal, cand, block_cand, counts, st) -> Sampled:
        if not self.fast_on:
            return super().sample(proposal, cand, block_cand, counts, st)
        B, G, V = proposal.logits.shape
        n = None if counts is None else sum(counts)
        if (n is None or not sampler.scoring_pays_off(B * G - n, V, None, proposal.logits.device)
                or not self.block_scores_suffice(proposal)):
            return super().sample(proposal, cand, block_cand, counts, st)
        return self.sample_at(proposal.logits, block_cand, n, st)

    def sample_at(self, logits, where, count: int, st) -> Sampled:
        """The policy's sampler at the ``count`` positions of ``where`` (known on the host: no read); elsewhere the
        confidence is ``-inf`` and the token 0. No distribution is kept."""
        B, G, V = logits.shape
        order = masked_order(where, count)
        part = sample_tokens(logits.reshape(B * G, V).index_select(0, order), **self.sampler_options(st))
        return Sampled(placed(part.confidence, order, (B, G), float("-inf")), placed(part.x0, order, (B, G), 0), None)


class FromBlockStart(FastLayer):
    """Samples from the block's first generated column on (KLASS: its ``pick`` reads the distributions of the block
    and of the later columns only; the earlier blocks are full, so no candidate lies there either) when sampling is
    per-position exact and the reference's every-position sampling is asked for (not ``sample_candidates_only``).
    Saves the softmax over the vocabulary at every column of the earlier blocks (in block ``k`` of ``n``, ``k / n``
    of them). Before the block the confidence is ``-inf`` and the token 0, and ``probs`` covers the columns from the
    block's start on (the policy reads the distributions as the last columns)."""

    def sample_from(self, st, proposal) -> int:
        """The first generated column sampled (0: every column)."""
        if self.cfg.sample_candidates_only or not per_position_exact(self.cfg, proposal):
            return 0
        return self.block_cols(st.block)[0]

    def sample(self, proposal, cand, block_cand, counts, st) -> Sampled:
        if not self.fast_on:
            return super().sample(proposal, cand, block_cand, counts, st)
        first = self.sample_from(st, proposal)
        if first == 0:
            return super().sample(proposal, cand, block_cand, counts, st)
        part = sample_tokens(proposal.logits[:, first:], **self.sampler_options(st))
        B, G = cand.shape
        conf = part.confidence.new_full((B, G), float("-inf"))
        conf[:, first:] = part.confidence
        x0 = part.x0.new_zeros((B, G))
        x0[:, first:] = part.x0
        return Sampled(conf, x0, part.probs)
