"""The assistant's message from its text: reasoning split off (``reasoning.py``), tool calls
read (``tool_parsers.py``), whole (``MessageReader.whole``) or streamed as OpenAI's deltas
(``MessageReader.stream``: ``reasoning_content``, ``content``, ``tool_calls`` chunks with index,
id and name first, then the arguments in pieces). Calls that do not parse (a name missing,
arguments that are not JSON, the text cut by the token budget) leave the whole answer as
content; a message with calls ends with finish_reason "tool_calls"."""
from __future__ import annotations

import json
from typing import Optional

from . import reasoning, tool_parsers
from .tools import ToolPlan, call_id


class MessageReader:
    def __init__(self, reasoning_parser: Optional[str], plan: ToolPlan = ToolPlan()):
        self.reasoning, self.plan = reasoning_parser, plan

    def _calls(self, answer: str, final: bool) -> tuple[str, list]:
        content, calls = tool_parsers.parse(self.plan.fmt, answer, final)
        if self.plan.name is not None:
            for c in calls:
                c[0] = self.plan.name
        return content, calls

    def whole(self, text: str) -> dict:
        """The message of a finished text (``role``, ``content``, maybe ``reasoning_content``
        and ``reasoning``, ``tool_calls``)."""
        r, answer = reasoning.split(self.reasoning, text) if self.reasoning else (None, text)
        msg = {"role": "assistant", "content": answer}
        if r is not None:
            msg["reasoning_content"] = msg["reasoning"] = r
        if self.plan.fmt is None:
            return msg
        content, calls = self._calls(answer, True)
        if not calls or not all(name and done and _is_json(args) for name, args, done in calls):
            return msg
        msg["content"] = content or None
        msg["tool_calls"] = [{"id": call_id(), "type": "function",
                              "function": {"name": name, "arguments": args}}
                             for name, args, _ in calls]
        return msg

    def stream(self) -> "MessageStream":
        return MessageStream(self)


def finish_reason(reason: Optional[str], has_calls: bool) -> Optional[str]:
    return "tool_calls" if has_calls and reason == "stop" else reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class MessageStream:
    """One choice's deltas; ``feed`` each new piece of text (``final``: the last)."""

    def __init__(self, reader: MessageReader):
        self.reader = reader
        self.think = reasoning.ReasoningStream(reader.reasoning) if reader.reasoning else None
        self.text = self.answer = ""
        self.sent_content = 0
        self.ids: list[str] = []  # per call announced: its id
        self.sent_args: list[int] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, piece: str, final: bool = False) -> dict:
        self.text += piece
        delta = {}
        if self.think is not None:
            new_r, new_c = self.think.feed(self.text, final)
            if new_r:
                delta["reasoning_content"] = delta["reasoning"] = new_r
        else:
            new_c = piece
        self.answer += new_c
        if self.reader.plan.fmt is None:
            if new_c:
                delta["content"] = new_c
            return delta
        content, calls = self.reader._calls(self.answer, final)
        if len(content) > self.sent_content:
            delta["content"] = content[self.sent_content:]
            self.sent_content = len(content)
        out = []
        for i, (name, args, _) in enumerate(calls):
            if name is None:
                break  # calls are announced in order, each once its name is known
            item = {"index": i}
            if i == len(self.ids):
                self.ids.append(call_id())
                self.sent_args.append(0)
                item.update(id=self.ids[i], type="function",
                            function={"name": name, "arguments": ""})
            new = args[self.sent_args[i]:]
            if new:
                item.setdefault("function", {})["arguments"] = new
                self.sent_args[i] = len(args)
            if len(item) > 1:
                out.append(item)
        if out:
            delta["tool_calls"] = out
        return delta
