"""A character-level tokenizer built offline with the ``tokenizers`` library.

Special tokens: [PAD]=0, [BOS]=1, [EOS]=2, [MASK]=3, [UNK]=4, then printable ASCII (32..126).
"""
from __future__ import annotations

from pathlib import Path

SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[MASK]", "[UNK]"]
PAD_ID, BOS_ID, EOS_ID, MASK_ID, UNK_ID = range(5)
CHARS = [chr(c) for c in range(32, 127)]


def build_char_tokenizer():
    """Return a ``transformers`` fast tokenizer over single characters (left padding)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
        mask_token="[MASK]", unk_token="[UNK]", padding_side="left",
    )
    return tok


def vocab_size() -> int:
    return len(SPECIALS) + len(CHARS)


def save_char_tokenizer(directory) -> None:
    build_char_tokenizer().save_pretrained(str(Path(directory)))
