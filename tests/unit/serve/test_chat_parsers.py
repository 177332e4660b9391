"""Reasoning and tool-call parsers on known texts of each format: whole, and streamed split at
every character boundary (the deltas add up to the whole message, tool calls accumulated as
openai's stream helper does)."""
import json

import pytest

from megainfer.config import ConfigError, ServeConfig
from megainfer.serve.chat_message import MessageReader
from megainfer.serve.reasoning import split
from megainfer.serve.tool_parsers import parse, value_end
from megainfer.serve.tools import ToolPlan

DS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      '{"city": "Oslo", "days": [1, 2]}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
      '<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "O\\"slo", '
          '"days": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}'
          '\n</tool_call>')
WANT_CALLS = {"hermes": [("get_weather", {"city": 'O"slo', "days": [1, {"a": "}"}]}),
                         ("now", {})],
              "deepseek_v3": [("get_weather", {"city": "Oslo", "days": [1, 2]}), ("now", {})]}


def _streamed(reader, text):
    """The message the deltas of ``text`` fed one character at a time add up to."""
    s = reader.stream()
    msg = {"content": "", "reasoning_content": "", "tool_calls": []}
    for i, ch in enumerate(text):
        d = s.feed(ch, i == len(text) - 1)
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        assert d.get("reasoning", "") == d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(msg["tool_calls"]):
                assert tc["id"].startswith("call_") and tc["function"]["name"]  # header first
                msg["tool_calls"].append({"name": tc["function"]["name"], "arguments": ""})
            msg["tool_calls"][tc["index"]]["arguments"] += tc["function"].get("arguments", "")
    return msg, s.has_calls


@pytest.mark.parametrize("name,text,reasoning,content", [
    ("deepseek_r1", "I think.\n</think>\n\nThe answer", "I think.\n", "\n\nThe answer"),
    ("deepseek_r1", "<think>I think.</think>Yes", "I think.", "Yes"),
    ("deepseek_r1", "still thinking <", "still thinking <", ""),
    ("qwen3", "<think>\nhmm</think>\n\nHi", "\nhmm", "\n\nHi"),
    ("qwen3", "Hi <thin", None, "Hi <thin"),
    ("qwen3", "No thinking </think> here", None, "No thinking </think> here"),
])
def test_reasoning_whole_and_streamed(name, text, reasoning, content):
    assert split(name, text) == (reasoning, content)
    reader = MessageReader(name)
    msg = reader.whole(text)
    assert msg.get("reasoning_content") == reasoning and msg["content"] == content
    got, _ = _streamed(reader, text)
    assert got["reasoning_content"] == (reasoning or "") and got["content"] == content


@pytest.mark.parametrize("fmt,text,content", [("hermes", HERMES, "Let me check."),
                                              ("deepseek_v3", "Sure." + DS, "Sure.")])
def test_tool_calls_whole_and_streamed(fmt, text, content):
    reader = MessageReader(None, ToolPlan(fmt))
    msg = reader.whole(text)
    assert msg["content"] == content
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in msg["tool_calls"]]
    assert calls == WANT_CALLS[fmt]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    got, has_calls = _streamed(reader, text)
    assert has_calls and got["content"] == content
    assert got["tool_calls"] == [{"name": c["function"]["name"],
                                  "arguments": c["function"]["arguments"]}
                                 for c in msg["tool_calls"]]


def test_reasoning_then_tool_calls():
    text = "<think>need the weather</think>" + HERMES
    reader = MessageReader("qwen3", ToolPlan("hermes"))
    msg = reader.whole(text)
    assert msg["reasoning_content"] == "need the weather" and len(msg["tool_calls"]) == 2
    got, _ = _streamed(reader, text)
    assert got["reasoning_content"] == "need the weather" and len(got["tool_calls"]) == 2


def test_forced_formats_and_broken_calls():
    text = '[{"name": "a", "parameters": {"x": [1]}}, {"name": "b", "parameters": {}}]'
    msg = MessageReader(None, ToolPlan("json_list")).whole(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] \
        == [("a", '{"x": [1]}'), ("b", "{}")] and msg["content"] is None
    got, _ = _streamed(MessageReader(None, ToolPlan("json_list")), text)
    assert got["tool_calls"] == [{"name": "a", "arguments": '{"x": [1]}'},
                                 {"name": "b", "arguments": "{}"}]
    named = MessageReader(None, ToolPlan("arguments", "f")).whole('{"q": 1}')
    assert named["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"q": 1}'}
    cut = '<tool_call>{"name": "f", "arguments": {"q": '  # the token budget ran out
    assert "tool_calls" not in MessageReader(None, ToolPlan("hermes")).whole(cut)
    assert parse("hermes", "plain <tool", final=False) == ("plain ", [])
    assert value_end('{"a": "}"} x', 0) == 10 and value_end('[1, {"b": 2}', 0) is None
    assert value_end(" 12,", 0) == 3 and value_end("12", 0) is None


def test_config_names_the_field():
    with pytest.raises(ConfigError, match="serve.reasoning_parser"):
        ServeConfig(reasoning_parser="r1")
    with pytest.raises(ConfigError, match="serve.tool_call_parser"):
        ServeConfig(tool_call_parser="mistral")
    with pytest.raises(ConfigError, match="serve.enable_auto_tool_choice"):
        ServeConfig(enable_auto_tool_choice=True)
    ServeConfig(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")


def test_think_open_reads_the_prompt():
    from megainfer.serve.reasoning import think_open
    assert think_open("<|im_start|>assistant\n")  # no block yet: the model may open one
    assert think_open("<｜Assistant｜><think>")  # the template opened it
    assert not think_open("assistant\n<think>\n\n</think>\n\n")  # thinking off: closed
    assert not think_open("<｜Assistant｜></think>")
