"""Tool calls read from a model's text (``serve.tool_call_parser``), whole or as it streams.

``parse(fmt, text, final)`` gives (content, calls): ``calls`` a list of ``[name or None,
arguments text, complete]``. Invariant: with ``final=False`` the text may still grow, and every
field is a prefix of what the longer text gives (streaming sends the differences). Formats:
``hermes`` (Qwen2.5 / Qwen3 ``<tool_call>`` blocks), ``deepseek_v3`` (its tool-call special
tokens around a ```` ```json ```` fence), ``json_list`` (``tool_choice="required"``, the
grammar's output) and ``arguments`` (a named ``tool_choice``: the whole text). The content is
the text before the first call; the arguments are the model's own JSON text, not
re-serialised. docs/serve.md, "Structured outputs, tool calls, reasoning"."""
from __future__ import annotations

import json
import re
from typing import Optional

from .reasoning import hold_tag as _hold

H_START, H_END = "<tool_call>", "</tool_call>"
DS_BEGIN, DS_CALL, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_CALL_END, DS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_SCALAR_END = set(",}] \t\r\n")


def value_end(text: str, i: int) -> Optional[int]:
    """The end of the JSON value starting at ``text[i]`` (after blanks), or None when the text
    ends inside it."""
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    if text[i] not in "{[\"":
        while i < n and text[i] not in _SCALAR_END:
            i += 1
        return i if i < n else None
    depth, in_str, esc = 0, False, False
    for j in range(i, n):
        ch = text[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _object_call(text: str) -> list:
    """[name, arguments so far, complete] of one call object's (maybe partial) text."""
    m, a = _NAME.search(text), _ARGS.search(text)
    name = None if m is None else json.loads(f'"{m.group(1)}"')
    if a is None:
        return [name, "", False]
    end = value_end(text, a.end())
    start = a.end()
    return [name, text[start:end] if end is not None else text[start:].rstrip(), end is not None]


def _hermes(text: str, final: bool) -> tuple[str, list]:
    first = text.find(H_START)
    if first < 0:
        return (text if final else _hold(text, H_START)), []
    calls, pos = [], first
    while pos >= 0:
        body_start = pos + len(H_START)
        end = text.find(H_END, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        call = _object_call(body)
        call[2] = call[2] and (end >= 0 or final)
        calls.append(call)
        pos = -1 if end < 0 else text.find(H_START, end)
    return text[:first], calls


def _deepseek(text: str, final: bool) -> tuple[str, list]:
    first = text.find(DS_BEGIN)
    if first < 0:
        first = text.find(DS_CALL)
    if first < 0:
        return (text if final else _hold(_hold(text, DS_BEGIN), DS_CALL)), []
    calls = []
    for part in text[first:].split(DS_CALL)[1:]:
        if DS_SEP not in part:
            calls.append([None, "", False])
            continue
        head = part.split(DS_SEP, 1)[1]
        if "\n" not in head:
            calls.append([None, "", False])
            continue
        name, rest = head.split("\n", 1)
        rest = rest[len("```json\n"):] if rest.startswith("```json\n") else \
            ("" if "```json\n".startswith(rest) else rest)
        end = value_end(rest, 0)  # the arguments: the JSON value inside the fence
        args = rest.strip() if end is None else rest[:end].strip()
        calls.append([name.strip(), args, end is not None])
    return text[:first], calls


def _json_list(text: str, final: bool) -> tuple[str, list]:
    calls, i = [], text.find("[")
    if i < 0:
        return "", []
    i += 1
    while True:
        j = text.find("{", i)
        if j < 0:
            break
        end = value_end(text, j)
        call = _object_call(text[j:] if end is None else text[j:end])
        call[2] = call[2] and end is not None
        calls.append(call)
        if end is None:
            break
        i = end
    return "", calls


def parse(fmt: str, text: str, final: bool = True) -> tuple[str, list]:
    if fmt == "hermes":
        return _hermes(text, final)
    if fmt == "deepseek_v3":
        return _deepseek(text, final)
    if fmt == "json_list":
        return _json_list(text, final)
    return "", [[None, text if final else text.rstrip(), final]]  # "arguments": name given
