"""``factor``: Fast-dLLM factor-based parallel decoding (``get_transfer_index_dynamic``).

Candidates are ranked by confidence; the step commits the longest prefix of the ranking whose
members ``n >= 2`` satisfy ``c_(n) >= 1 - factor / (n + 1)`` (the first is always committed). As in
the reference, when only the last-ranked candidate fails, it is committed too. Larger ``factor`` =
more tokens per step. Block loop as ``threshold``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dlm_engine.core.blockwise import FillBlocks, FillBlocksConfig, FillPlan
from dlm_engine.errors import ConfigError
from dlm_engine.core.registry import register_strategy
from dlm_engine.core.selection import factor_commit


@dataclass
class FactorConfig(FillBlocksConfig):
    factor: float = 1.0                  # > 0; rank n (>= 2) passes iff (n + 1) * (1 - c_(n)) <= factor


@register_strategy("factor", FactorConfig)
class Factor(FillBlocks):
    def validate(self) -> None:
        super().validate()
        f = self.cfg.factor
        if f is None or not float(f) > 0:
            raise ConfigError(f"strategy.factor={f} must be > 0")

    def select(self, canvas, plan, proposal, st):
        """The block's masked positions per row are its candidates' number only when the call computed every
        column (no ``valid``): otherwise the rule counts the candidates on the device."""
        if proposal.valid is not None:
            plan = dataclasses.replace(plan, data=FillPlan(None))
        return super().select(canvas, plan, proposal, st)

    def rule(self, conf, cand, cur, span=None, counts=None):
        return factor_commit(conf, cand, float(self.cfg.factor), span, counts)
