"""Capabilities: what a strategy and a cache need from each other, so compatibility is computed.

A strategy *offers* facts about its steps (e.g. that every step names its block) and *needs* facts about
the logits a cache lets the model produce; a cache does the reverse. A pair works when each side's
needs are a subset of the other side's offers. Neither side names the other's registry key, so a cache
or strategy from outside the package pairs with every compatible partner.
"""
from __future__ import annotations

from enum import Enum
from typing import FrozenSet, Iterable, Optional


class Cap(str, Enum):
    """One capability (described in ``_DOCS``). Strategies offer and caches need ``BLOCKS``,
    ``BLOCK_HANDOVER`` and ``STORE_FORWARDS``; caches offer and strategies need the others."""

    BLOCKS = "blocks"
    BLOCK_HANDOVER = "block_handover"
    BLOCK_LOGITS = "block_logits"
    SUFFIX_LOGITS = "suffix_logits"
    WINDOW_LOGITS = "window_logits"
    AUX_COLUMNS = "aux_columns"
    BLOCK_KV = "block_kv"
    STORE_FORWARDS = "store_forwards"
    SOFT_INPUTS = "soft_inputs"

    @property
    def doc(self) -> str:
        return _DOCS[self]


_DOCS = {
    Cap.BLOCKS: "every step names the block it decodes",
    Cap.BLOCK_HANDOVER: "completed blocks are handed over for storage",
    Cap.BLOCK_LOGITS: "valid logits for every column of the step's block",
    Cap.SUFFIX_LOGITS: "valid logits from the block start to the end of the canvas",
    Cap.WINDOW_LOGITS: "valid logits for any window, whatever the block",
    Cap.AUX_COLUMNS: "extra query columns appended after the canvas",
    Cap.STORE_FORWARDS: "a completed block is stored by a forward over its final tokens and every step names its "
                        "mask's block size (the block-diffusion references' prefill and store forwards)",
    Cap.SOFT_INPUTS: "the model embeds a mixture of token embeddings and the mask embedding at the columns a "
                     "strategy names (CallRequest.soft)",
    Cap.BLOCK_KV: "a call may query part of its block against the stored prefix and the block's stored slots "
                  "(CacheDirective.query / key_start)",
}

Caps = FrozenSet[Cap]


def caps(*items: Cap) -> Caps:
    return frozenset(Cap(c) for c in items)


def missing(needs: Iterable[Cap], offers: Iterable[Cap]) -> Caps:
    return frozenset(needs) - frozenset(offers)


def incompatibility(strategy, cache) -> Optional[str]:
    """Why ``strategy`` and ``cache`` do not pair (None: they do), with the strategy's hint of a setting that
    would make them pair, if it has one."""
    problem = _incompatibility(strategy, cache)
    hint = strategy.cache_hint(cache) if problem is not None and hasattr(strategy, "cache_hint") else None
    return problem if not hint else f"{problem}; {hint}"


def _incompatibility(strategy, cache) -> Optional[str]:
    s_name = getattr(strategy, "label", None) or getattr(strategy, "name", type(strategy).__name__)
    c_name = getattr(cache, "name", type(cache).__name__)
    lack = missing(strategy.needs, cache.offers)
    if lack:
        what = "; ".join(f"'{c.value}' ({c.doc})" for c in sorted(lack, key=lambda c: c.value))
        return f"cache={c_name} does not provide what strategy={s_name} needs: {what}"
    lack = missing(cache.needs, strategy.offers)
    if lack:
        what = "; ".join(f"'{c.value}' ({c.doc})" for c in sorted(lack, key=lambda c: c.value))
        return f"strategy={s_name} does not provide what cache={c_name} needs: {what}"
    return None


def model_incompatibility(strategy, model) -> Optional[str]:
    """Why ``strategy`` cannot decode with ``model`` (None = it can). A strategy's ``model_needs`` (e.g.
    ``soft_inputs``) must be among the model's ``offers``. A block-diffusion model (``block_diffusion``
    true: block-causal attention, blocks of ``block_size``) needs a strategy that decodes block by block (offers
    ``blocks``) with the model's block size, unless the strategy sets the mask's blocks itself
    (``sets_attention_blocks``: the block-diffusion references)."""
    lack = missing(getattr(strategy, "model_needs", ()), getattr(model, "offers", ()))
    if lack:
        mtype = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        what = "; ".join(f"'{c.value}' ({c.doc})" for c in sorted(lack, key=lambda c: c.value))
        return (f"model {mtype} does not provide what strategy={getattr(strategy, 'name', type(strategy).__name__)} "
                f"needs: {what}")
    if not getattr(model, "block_diffusion", False) or getattr(strategy, "sets_attention_blocks", False):
        return None
    name = getattr(strategy, "name", type(strategy).__name__)
    size = int(model.block_size)
    mtype = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if Cap.BLOCKS not in strategy.offers:
        return (f"strategy={name} needs bidirectional attention over the whole generation, which the block-causal "
                f"model ({mtype}, blocks of {size}) lacks: use a block-by-block strategy (one that offers "
                f"'{Cap.BLOCKS.value}') with strategy.block_length={size}")
    adaptive = getattr(strategy, "adaptive_block_key", None)   # a strategy sizing its blocks as it goes (CadLLM)
    if adaptive:
        fixed = getattr(strategy, "fixed_block_key", "strategy.block_length")
        return (f"strategy={name} sizes its blocks adaptively ({adaptive}=true), which the block-causal model "
                f"({mtype}, blocks of {size}) does not allow: set {adaptive}=false {fixed}={size}")
    fixed = getattr(strategy, "fixed_block_key", "strategy.block_length")
    length = getattr(strategy, "block_length", None)      # the resolved size (a null block_length = gen_length)
    if length is None:
        length = getattr(strategy, "block_len", None)       # (the d2c family's name for it)
    if length is None:
        length = getattr(getattr(strategy, "cfg", None), "block_length", None)
    if length is not None and int(length) != size:
        return (f"{fixed}={length} conflicts with the block size of the block-causal model "
                f"({mtype}: {size}); set {fixed}={size}")
    return None
