"""Reasoning parsers (``serve.reasoning_parser``): a reasoning model's ``<think>...</think>``
block split off its answer, whole (``split``) or as the text streams (``ReasoningStream``).

``deepseek_r1``: the output starts inside the block (DeepSeek-R1's template opens it in the
prompt; a ``<think>`` the model writes itself is dropped); everything up to ``</think>`` is
reasoning, the rest the answer; no ``</think>`` yet: all reasoning. ``qwen3``: a block only
when the output opens one (Qwen3 writes ``<think>`` itself; with ``enable_thinking=false`` its template closes an empty block in the
prompt and the output is all answer)."""
from __future__ import annotations

from typing import Optional

START, END = "<think>", "</think>"


def split(name: str, text: str, final: bool = True) -> tuple[Optional[str], str]:
    """(reasoning or None, answer) of ``text``. ``final=False``: ``text`` may grow, so a tail
    that could be the start of a tag is left out of both (streaming sends it later)."""
    body = text.lstrip()
    opened = body.startswith(START)
    if opened:
        body = body[len(START):]
    elif not final and START.startswith(body):
        return None, ""  # maybe the start of <think> (or only blanks so far)
    else:
        body = text
    if name == "qwen3" and not opened:
        return None, text
    end = body.find(END)
    if end >= 0:
        return body[:end], body[end + len(END):]
    return (body if final else hold_tag(body, END)), ""


def think_open(prompt: str) -> bool:
    """Whether the output may start inside a think block: the prompt does not close one
    after its last ``<think>`` (a template that turns thinking off closes it there)."""
    return prompt.rfind(END) <= prompt.rfind(START)


def hold_tag(text: str, tag: str) -> str:
    """``text`` without a tail that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


class ReasoningStream:
    """The deltas of reasoning and answer as the text grows; ``feed`` the whole text so far."""

    def __init__(self, name: str):
        self.name, self.sent_r, self.sent_c = name, 0, 0

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new answer) since the last call."""
        r, c = split(self.name, text, final)
        r = r or ""
        new_r, new_c = r[self.sent_r:], c[self.sent_c:]
        self.sent_r, self.sent_c = max(self.sent_r, len(r)), max(self.sent_c, len(c))
        return new_r, new_c
