"""Turning token ids of a trace into text without importing torch or transformers where possible.

* ``{"kind": "char"}`` (the embedded model's character tokenizer): decoded here, in pure Python, exactly as
  ``dlm_engine.models.tokenizer.build_char_tokenizer().decode(ids, skip_special_tokens=True)`` does.
* ``{"kind": "hf", "path": ..., "digest": ...}``: the path in a trace header is never followed on its own
  (a trace may come from anyone). The user names a tokenizer directory (``dlm-trace ... --tokenizer DIR``,
  ``open_trace(path, tokenizer=DIR)``); it is loaded with the loader ``dlm`` uses and must match the
  recorded digest. Without one, ids are shown.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence


class CharText:
    """The embedded character tokenizer: specials (skipped when decoding), then printable ASCII."""

    def __init__(self):
        from dlm_engine.models.tokenizer import CHARS, SPECIALS

        self._tokens = list(SPECIALS) + list(CHARS)
        self._n_special = len(SPECIALS)

    def decode(self, ids: Sequence[int]) -> str:
        toks, n0 = self._tokens, self._n_special
        return "".join(toks[i] for i in ids if n0 <= i < len(toks))

    def token(self, tid: int) -> Optional[str]:
        return self._tokens[tid] if 0 <= tid < len(self._tokens) else None


class HFText:
    """A checkpoint directory's tokenizer (named by the user), loaded without remote code."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token(self, tid: int) -> Optional[str]:
        try:
            out = self._tok.convert_ids_to_tokens([int(tid)])[0]
        except Exception:
            return None
        return None if out is None else str(out)


def text_decoder(spec, directory=None, notes: Optional[List[str]] = None):
    """The decoder for a header's ``tokenizer`` spec, or None (ids are shown). ``notes`` gets one line
    saying why text is not available when it is not."""
    notes = notes if notes is not None else []
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if directory is None:
        if kind == "char":
            return CharText()
        if kind == "hf":
            own = _embedded_match(spec.get("digest"))
            if own is not None:
                return own
            notes.append(f"text shown as token ids: the trace was decoded with the tokenizer in "
                         f"'{spec.get('path')}'; pass --tokenizer DIR to use one (header paths are not followed)")
        return None
    from dlm_engine.errors import UserError

    d = Path(directory).expanduser()
    if not d.is_dir():
        raise UserError(f"--tokenizer: '{d}' is not a directory")
    from dlm_engine.models.chat import has_tokenizer, load_tokenizer
    from dlm_engine.models.loader import check_tokenizer_config

    check_tokenizer_config(d)
    if not has_tokenizer(d):
        raise UserError(f"--tokenizer: '{d}' holds no tokenizer (tokenizer.json, or vocab.json + merges.txt)")
    import logging

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)   # the checkpoint's config.json is not a transformers model type
    try:
        tok, digest = load_tokenizer(d)
    finally:
        hf_logging.set_verbosity(level)
    want = spec.get("digest") if isinstance(spec, dict) else None
    if want and digest != want:
        notes.append(f"--tokenizer: '{d}' differs from the recorded tokenizer ({digest} vs {want}); text may be wrong")
    return HFText(tok)


def _embedded_match(digest):
    """The decoder of a checkpoint shipped with this installation whose tokenizer has ``digest`` (the
    embedded model's traces show text without a named directory: nothing from the header is followed)."""
    if not isinstance(digest, str):
        return None
    from dlm_engine.checkpoints import HERE
    from dlm_engine.models.chat import has_tokenizer, tokenizer_digest

    for d in sorted(p for p in HERE.iterdir() if p.is_dir()):
        if has_tokenizer(d) and tokenizer_digest(d) == digest:
            if _is_char_tokenizer(d):
                return CharText()
            return text_decoder({"digest": digest}, d)
    return None


def _is_char_tokenizer(d: Path) -> bool:
    """True when ``d/tokenizer.json`` is exactly the character tokenizer :class:`CharText` decodes."""
    import json

    from dlm_engine.models.tokenizer import CHARS, SPECIALS

    try:
        t = json.loads((d / "tokenizer.json").read_text())
        model, dec = t.get("model") or {}, t.get("decoder") or {}
        specials = sorted((a["id"], a["content"]) for a in t.get("added_tokens", []) if a.get("special"))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False
    want = {tok: i for i, tok in enumerate(list(SPECIALS) + list(CHARS))}
    return (model.get("type") == "WordLevel" and model.get("vocab") == want and dec.get("type") == "Fuse"
            and specials == [(i, tok) for i, tok in enumerate(SPECIALS)])
