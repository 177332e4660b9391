"""Incremental detokenisation and stop strings: the one rule the engine (to finish a request on a
stop string) and the streaming frontend (``megainfer.AsyncLLM``'s text) share.

The text state is three fields on any object (``Request``, ``SampleText``): ``text`` (complete
characters so far), ``prefix_offset`` and ``read_offset`` (vLLM's offsets into the output ids).
A step appends text only when the decoded tail does not end in U+FFFD, so a UTF-8 character
whose bytes span several tokens appears whole, in one step, never split.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


def decode_text(tokenizer, ids: Sequence[int], skip_special: bool = True) -> str:
    """``ids`` as text; ``skip_special=False`` asks the tokenizer to keep special tokens (a
    tokenizer of the ``Tokenizer`` protocol's older one-argument form still serves the
    default)."""
    return tokenizer.decode(ids) if skip_special else \
        tokenizer.decode(ids, skip_special_tokens=False)


def detokenize_step(state, tokenizer, ids: Sequence[int], skip_special: bool = True) -> int:
    """Append to ``state.text`` the text ``ids`` (all output ids so far) add, once it is
    complete; returns the number of new characters (0 while a character is partial).
    ``skip_special``: special tokens add no text (``SamplingParams.skip_special_tokens``)."""
    prefix = decode_text(tokenizer, ids[state.prefix_offset:state.read_offset], skip_special)
    new = decode_text(tokenizer, ids[state.prefix_offset:], skip_special)
    if len(new) > len(prefix) and not new.endswith("\ufffd"):
        delta = new[len(prefix):]
        state.text += delta
        state.prefix_offset, state.read_offset = state.read_offset, len(ids)
        return len(delta)
    return 0


def find_stop_string(state, stop: Sequence[str], include_stop: bool, new_chars: int
                     ) -> Optional[str]:
    """vLLM's check: a stop string in the last ``new_chars`` + its length characters of
    ``state.text``; cut the text before it (after it with ``include_stop``) and return it."""
    for s in stop:
        i = state.text.find(s, 1 - new_chars - len(s))
        if i == -1:
            continue
        if include_stop:
            i += len(s)
        state.text = state.text[:i]
        return s
    return None


@dataclass
class SampleText:
    """One sample's streamed text in the frontend: complete characters only, and while it runs
    the last ``len(longest stop string) - 1`` characters held back (they may begin a stop
    string the engine will cut), as vLLM does."""

    tokenizer: object
    stop: Sequence[str] = ()
    skip_special: bool = True
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    token_ids: list[int] = field(default_factory=list)

    def add(self, new_ids: Sequence[int]) -> None:
        self.token_ids += new_ids
        detokenize_step(self, self.tokenizer, self.token_ids, self.skip_special)

    def visible(self) -> str:
        hold = max((len(s) for s in self.stop), default=1) - 1
        return self.text[:len(self.text) - hold] if hold else self.text
