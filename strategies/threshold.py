"""``threshold``: Fast-dLLM confidence-aware parallel decoding.

Blocks are decoded one after the other; each step commits the most confident masked position of
the block **and** every other one whose confidence (float64 softmax probability of the proposal)
is at least ``threshold`` (ties commit). A block ends as soon as it is full, so NFE is
data-dependent: between 1 and ``block_length`` forwards per block.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlm_engine.core.blockwise import FillBlocks, FillBlocksConfig
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.selection import threshold_commit


@dataclass
class ThresholdConfig(FillBlocksConfig):
    threshold: float = 0.9               # commit every candidate with confidence >= threshold (top-1 always)


@register_strategy("threshold", ThresholdConfig)
class Threshold(FillBlocks):
    def validate(self) -> None:
        super().validate()
        self.check_threshold("threshold", self.cfg.threshold)      # a probability: (0, 1]

    def rule(self, conf, cand, cur, span=None, counts=None):
        return threshold_commit(conf, cand, float(self.cfg.threshold), span, counts)
