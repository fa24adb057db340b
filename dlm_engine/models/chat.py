"""Tokenizers of official checkpoint directories, chat templates and special-token ids.

* :func:`load_tokenizer` loads a directory's tokenizer without remote code. Checkpoints whose
  ``tokenizer_config.json`` names a remote-code class (Dream's ``DreamTokenizer``, a Qwen2 byte-level
  BPE) fall back to the built-in fast tokenizer over the same ``tokenizer.json`` / ``vocab.json`` +
  ``merges.txt``; the chat template and special tokens still come from ``tokenizer_config.json``.
* :func:`use_chat_template` resolves ``model.chat_template=auto|on|off`` (auto: on for instruct presets
  whose tokenizer has a template).
* :func:`encode_chat` turns a user message into ids the way the official chat examples do: the template
  with the generation prompt, tokenised without adding special tokens again.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import List, Optional, Tuple

from dlm_engine.errors import ConfigError, UserError

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# end-of-turn tokens of the supported families (used when config.json names none)
EOT_TOKENS = ("<|eot_id|>", "<|im_end|>")
CHAT_MODES = ("auto", "on", "off")


def has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or ((path / "vocab.json").is_file() and (path / "merges.txt").is_file())


def tokenizer_digest(path: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return "sha256:" + h.hexdigest()


def load_tokenizer(path) -> Tuple[object, Optional[str]]:
    """``(tokenizer, digest)`` of a checkpoint directory, or ``(None, None)`` when it ships none."""
    path = Path(path).expanduser()
    if not has_tokenizer(path):
        return None, None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as first:  # remote-code tokenizer class: use the built-in one over the same files
        tok = _builtin_tokenizer(path, first)
    tok.padding_side = "left"
    return tok, tokenizer_digest(path)


def _builtin_tokenizer(path: Path, first: Exception):
    from transformers import PreTrainedTokenizerFast

    try:
        if (path / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(path), trust_remote_code=False)
        from transformers import Qwen2Tokenizer

        return Qwen2Tokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:
        raise UserError(f"model.path: cannot load the tokenizer in '{path}' ({first}; built-in fallback: {exc})") from None


def has_chat_template(tok) -> bool:
    return tok is not None and bool(getattr(tok, "chat_template", None))


def use_chat_template(mode: str, instruct: bool, tok, where: str = "") -> bool:
    """Resolve ``model.chat_template``: ``on`` needs a template, ``auto`` = on for instruct models with one."""
    if mode not in CHAT_MODES:
        raise ConfigError(f"model.chat_template='{mode}' (choose auto, on or off)")
    if mode == "off":
        return False
    if mode == "on":
        if not has_chat_template(tok):
            raise UserError(f"model.chat_template=on but the tokenizer{(' in ' + where) if where else ''} "
                            "has no chat template (use model.chat_template=off)")
        return True
    return bool(instruct) and has_chat_template(tok)


def encode_chat(tok, text: str) -> List[int]:
    """One user turn with the assistant's generation prompt, as the official chat examples build it."""
    return encode_messages(tok, [{"role": "user", "content": text}])


def encode_messages(tok, messages) -> List[int]:
    """A conversation rendered with the tokenizer's template plus the generation prompt, tokenised without
    adding special tokens again."""
    rendered = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tok(rendered, add_special_tokens=False)["input_ids"])


def end_of_turn_id(raw_config: dict, tok, override: Optional[int] = None, vocab_size: Optional[int] = None
                   ) -> Optional[int]:
    """End-of-turn id: ``model.eot_token_id`` if set, else config.json's ``eot_token_id``, else the id the
    checkpoint's own tokenizer gives its EoT token (``<|eot_id|>``, ``<|im_end|>``)."""
    if override is not None:
        if vocab_size is not None and not 0 <= int(override) < int(vocab_size):
            raise UserError(f"model.eot_token_id={override} is outside this model's vocabulary (0..{int(vocab_size) - 1})")
        return int(override)
    if raw_config.get("eot_token_id") is not None:
        return int(raw_config["eot_token_id"])
    if tok is not None:
        unk = getattr(tok, "unk_token_id", None)
        for t in EOT_TOKENS:
            i = tok.convert_tokens_to_ids(t)
            if isinstance(i, int) and i != unk and i >= 0:
                return i
    return None


