"""Text <-> token ids: the checkpoint's own tokenizer when it has one, else raw UTF-8 bytes.

``tokenizer.json`` loads with the ``tokenizers`` library (no code from the checkpoint runs);
without it every byte of the UTF-8 encoding is one token id (0..255), which round-trips any
text for a model whose vocabulary has at least 256 entries.
"""
from __future__ import annotations

import os
from functools import cached_property
from typing import Optional, Protocol, Sequence

from tokenizers import Tokenizer as _Tok


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids. Ids >= 256 (not bytes) and eos ids decode to nothing (they
    have no text, skipped or not)."""

    name = "bytes"
    max_token_chars = 1  # one byte a token, and a character is at least one byte

    def __init__(self, special_ids: Sequence[int] = ()):
        self.special = frozenset(special_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256 and i not in self.special).decode(
            "utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (Hugging Face tokenizers). Adds the special tokens its
    post-processor defines (e.g. BOS) on encode; skips special tokens on decode unless told
    otherwise (``SamplingParams.skip_special_tokens``)."""

    name = "tokenizer.json"

    def __init__(self, path: str):
        self.path = path  # the grammars' cache key (grammar.py)
        self.tok = _Tok.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token's length in the vocabulary's own spelling (byte-level BPE: one
        character a byte), an upper bound on the characters of text one token covers."""
        return max(len(t) for t in self.tok.get_vocab(with_added_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def max_prompt_chars(tokenizer, max_model_len: int) -> Optional[int]:
    """Characters beyond which a text is sure to tokenise to more than ``max_model_len``
    tokens (with a margin of 2x for normalisers), so it is refused without tokenising; None
    for a tokenizer of the caller's own (no bound known)."""
    if isinstance(tokenizer, (ByteTokenizer, HFTokenizer)):
        return 2 * max_model_len * tokenizer.max_token_chars + 64
    return None


def load_tokenizer(path: Optional[str], eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """The checkpoint directory's ``tokenizer.json``, or the byte-level fallback."""
    if path:
        tj = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tj):
            return HFTokenizer(tj)
    return ByteTokenizer(eos_token_ids)
