"""Prompts in, token ids out: ``prompts_file`` (plain text or JSONL), chat messages, and the checks that need
the model (context length, vocabulary, characters its tokenizer cannot represent).

A ``prompts_file`` ending in ``.jsonl`` holds one JSON object per line: ``{"prompt": "..."}`` (any text,
multi-line and few-shot prompts included) or ``{"messages": [{"role": ..., "content": ...}, ...]}`` (rendered
with the tokenizer's chat template); other keys of a line are kept in ``results.jsonl`` as ``meta``. Any
other file is plain text, one prompt per line (blank lines skipped).
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from dlm_engine.errors import ConfigError, UserError

JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass
class Prompt:
    """One prompt: ``text`` (what is shown as ``prompt``), or chat ``messages``; ``meta`` = other JSONL keys."""

    text: Optional[str] = None
    messages: Optional[List[Dict[str, str]]] = None
    ids: Optional[List[int]] = None
    meta: Dict[str, Any] = field(default_factory=dict)

    @property
    def shown(self) -> Optional[str]:
        if self.text is not None:
            return self.text
        if self.messages:
            return str(self.messages[-1].get("content", ""))
        return None


def read_prompts_file(path: Union[str, Path]) -> List[Prompt]:
    """Every prompt of a ``prompts_file`` (the file read once); :class:`ConfigError` naming the file (and line)
    otherwise: a directory, a missing file, a binary or non-UTF-8 file, a bad JSONL line, no prompts."""
    p = Path(str(path)).expanduser()
    if p.is_dir():
        raise ConfigError(f"prompts_file: '{path}' is a directory, not a file")
    if not p.exists():
        raise ConfigError(f"prompts_file: '{path}' does not exist")
    text = check_text_file(str(p), "prompts_file", shown=str(path))
    if p.suffix.lower() in JSONL_SUFFIXES:
        prompts = [_jsonl_prompt(line, n, path) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    else:
        prompts = [Prompt(text=line) for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"prompts_file: '{path}' holds no prompts (it is empty or has only blank lines)")
    return prompts


def check_text_file(path: str, key: str, shown: Optional[str] = None) -> str:
    """The text of a UTF-8 file; a binary file or one that is not UTF-8 is a ConfigError naming the key, the file
    (``shown``: as the user gave it) and the byte."""
    shown = path if shown is None else shown
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read '{shown}' ({exc.strerror or exc})") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"{key}: '{shown}' is a binary file (a NUL byte at offset {nul}), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{key}: '{shown}' is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def _jsonl_prompt(line: str, n: int, path) -> Prompt:
    where = f"prompts_file: line {n} of '{path}'"
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where} is not valid JSON ({exc})") from None
    try:
        return as_prompt(obj)
    except UserError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def as_prompt(item: Any) -> Prompt:
    """A prompt from a string, a token-id list, ``{"prompt": str}`` or ``{"messages": [...]}``."""
    if isinstance(item, Prompt):
        return item
    if isinstance(item, str):
        return Prompt(text=item)
    if isinstance(item, dict):
        meta = {k: v for k, v in item.items() if k not in ("prompt", "messages")}
        if "prompt" in item and "messages" not in item:
            if not isinstance(item["prompt"], str):
                raise UserError(f'"prompt" must be a string, got {type(item["prompt"]).__name__}')
            return Prompt(text=item["prompt"], meta=meta)
        if "messages" in item and "prompt" not in item:
            msgs = item["messages"]
            if (not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs)):
                raise UserError('"messages" must be a non-empty list of {"role": str, "content": str}')
            return Prompt(messages=[{"role": m["role"], "content": m["content"]} for m in msgs], meta=meta)
        raise UserError('expected an object with either "prompt" (a string) or "messages" (a chat)')
    if hasattr(item, "tolist"):
        item = item.tolist()
    if isinstance(item, (list, tuple)) and all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                                               for x in item):
        return Prompt(ids=[int(x) for x in item])
    raise UserError(f"expected a string, a list of token ids, {{\"prompt\": ...}} or {{\"messages\": [...]}}, "
                    f"got {type(item).__name__}")


def encode(lm, prompts: Sequence[Prompt]) -> Tuple[List[List[int]], Set[str]]:
    """Token ids of every prompt and the characters the tokenizer could not represent (it gave them its
    unknown token). Token ids are checked against the vocabulary; errors name the prompt."""
    ids, lost = [], set()
    vocab = lm.vocab_size
    for i, p in enumerate(prompts):
        try:
            if p.ids is not None:
                x = list(p.ids)
            elif p.messages is not None:
                x = _encode_messages(lm, p.messages)
                lost |= unrepresentable(lm, " ".join(m["content"] for m in p.messages), x)
            else:
                x = lm.encode(p.text)
                lost |= unrepresentable(lm, p.text, x)
        except UserError as exc:
            raise UserError(f"prompt {i}: {exc}") from None
        bad = [t for t in x if vocab and not 0 <= t < vocab]
        if bad:
            raise UserError(f"prompt {i}: token id {bad[0]} is outside the vocabulary of model '{lm.name}' "
                            f"(0..{vocab - 1})")
        ids.append(x)
    return ids, lost


def _encode_messages(lm, messages) -> List[int]:
    from dlm_engine.models.chat import encode_messages, has_chat_template

    if not has_chat_template(lm.tokenizer):
        raise UserError(f"chat messages need a tokenizer with a chat template; model '{lm.name}' has none "
                        '(give {"prompt": "..."} instead)')
    return encode_messages(lm.tokenizer, messages)


def unrepresentable(lm, text: str, ids: Sequence[int]) -> Set[str]:
    """Characters of ``text`` that the tokenizer encodes as its unknown token (empty when ``ids`` holds none)."""
    tok = lm.tokenizer
    unk = getattr(tok, "unk_token_id", None) if tok is not None else None
    if unk is None or unk not in ids:
        return set()
    return {ch for ch in set(text) if unk in tok(ch, add_special_tokens=False)["input_ids"]}


def describe_chars(chars: Set[str]) -> str:
    shown = sorted(chars)[:10]
    return ", ".join(repr(c) for c in shown) + (f" and {len(chars) - 10} more" if len(chars) > 10 else "")


def prepare(lm, prompts: Sequence[Any], gen_length: int, cfg=None,
            empty_ids: bool = True) -> Tuple[List[Prompt], List[List[int]], Optional[str]]:
    """Everything between the prompts a user gave and decoding: each as a :class:`Prompt` (errors name its
    index), the strategy config's token ids (``cfg``) and every prompt's ids checked against the model's
    vocabulary, prompt + ``gen_length`` against its context. Returns (prompts, token ids, the warning
    about characters the tokenizer cannot represent and empty prompts, or None). ``empty_ids=False``: an empty
    token-id list is not warned about (ids that :func:`prepare` made already, warned about then)."""
    items = []
    for i, p in enumerate(prompts):
        try:
            items.append(as_prompt(p))
        except UserError as exc:
            raise UserError(f"prompt {i}: {exc}") from None
    if cfg is not None:
        check_token_ids(cfg, lm)
    ids, lost = encode(lm, items)
    check_lengths(lm, ids, int(gen_length))
    warnings = []
    if lost:
        warnings.append(f"the prompts contain characters model '{lm.name}' cannot represent ({describe_chars(lost)}); "
                        "its tokenizer encodes them as its unknown token")
    empty = [i for i, p in enumerate(items) if (p.text is not None and not p.text.strip()) or (empty_ids and p.ids == [])]
    if empty:
        which = ", ".join(map(str, empty[:10])) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        warnings.append(f"prompt{'s' if len(empty) > 1 else ''} {which} {'are' if len(empty) > 1 else 'is'} empty: "
                        "decoded without a prompt (unconditional generation)")
    return items, ids, "; ".join(warnings) or None


def _declared(model_config: Dict[str, Any]) -> Optional[Tuple[str, int]]:
    """``(key, value)`` of the context length a model config declares, if it declares one."""
    for key in ("max_sequence_length", "max_position_embeddings"):
        v = model_config.get(key)
        if isinstance(v, int) and v > 0:
            return key, v
    return None


def max_length(model_config: Dict[str, Any], override: Optional[int] = None) -> Optional[int]:
    """The longest canvas (prompt + generation) a run may use: ``override`` (``model.max_length``) when set,
    else what the model config declares, if it declares anything."""
    if override is not None:
        return int(override)
    declared = _declared(model_config)
    return None if declared is None else declared[1]


def _limit_text(model_config: Dict[str, Any], override: Optional[int]) -> str:
    if override is not None:
        return f"model.max_length={int(override)}"
    key, v = _declared(model_config)
    return f"{key}={v}; model.max_length=N runs a RoPE model past it"


def check_max_length(override: Any) -> Optional[int]:
    """``model.max_length`` is null or a positive integer."""
    if override is None:
        return None
    if isinstance(override, bool) or not isinstance(override, int) or override <= 0:
        raise ConfigError(f"model.max_length must be a positive integer or null (got {override!r})")
    return override


def check_gen_length(gen_length: int, model_config: Dict[str, Any], name: str, override: Optional[int] = None) -> None:
    limit = max_length(model_config, override)
    if limit is not None and gen_length > limit:
        raise ConfigError(f"gen_length={gen_length} is more than model '{name}' supports "
                          f"({_limit_text(model_config, override)})")


def check_lengths(lm, ids: Sequence[Sequence[int]], gen_length: int) -> None:
    """Every prompt plus ``gen_length`` fits the model's context: else one line naming the first prompt."""
    override = getattr(lm, "max_length", None)
    check_gen_length(gen_length, lm.config, lm.name, override)
    limit = max_length(lm.config, override)
    if limit is None:
        return
    long = [i for i, x in enumerate(ids) if len(x) + gen_length > limit]
    if long:
        i = long[0]
        more = f" (and {len(long) - 1} more prompts)" if len(long) > 1 else ""
        raise UserError(f"prompt {i} has {len(ids[i])} tokens: with gen_length={gen_length} it needs "
                        f"{len(ids[i]) + gen_length} positions, more than model '{lm.name}' supports "
                        f"({_limit_text(lm.config, override)}){more}")


def check_token_ids(cfg, lm) -> None:
    """Token ids in the strategy config (``early_exit`` constraints) lie in the model's vocabulary."""
    vocab = lm.vocab_size
    for n, pair in enumerate(cfg.strategy.get("constraints") or []):
        token = int(pair[1])
        if vocab and not 0 <= token < vocab:
            raise ConfigError(f"strategy.constraints[{n}]: token id {token} is outside the vocabulary of model "
                              f"'{lm.name}' (0..{vocab - 1})")
