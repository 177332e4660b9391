"""Tool calls and reasoning served, through the official openai client, on a random tiny
Qwen3-style checkpoint with a real byte-level BPE tokenizer and its chat template
(``make_tiny(tokenizer="qwen3")``): tool_choice required and named make even a random model
call with arguments that validate against the function's schema; auto reads the hermes
format; reasoning_content comes apart from content; streamed equals non-streamed; tool
results render; bad tools and choices are 400s naming the field."""
import json

import jsonschema_rs
import openai
import pytest

from serve_util import ThreadServer

KW = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024, num_blocks=3000,
          block_size=4)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
NOW = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": NOW}}]
SCHEMAS = {"get_weather": WEATHER, "now": NOW}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}  # the block closed in the prompt
HERMES = '<tool_call>{"name": "now", "arguments": {"tz": "CET"}}</tool_call>'


def _tool_server(tmp_path_factory, family: str, style: str, reasoning: str, parser: str):
    """A server over a tiny ``family`` checkpoint with ``style``'s tokenizer and template,
    auto tool choice through ``parser``; yields its openai client."""
    from megainfer.tools.make_tiny import make_tiny
    d = make_tiny(family, str(tmp_path_factory.mktemp(style) / "ckpt"), seed=2,
                  tokenizer=style, max_pos=1024)
    s = ThreadServer(d, llm_kw=KW, api_key="k", reasoning_parser=reasoning,
                     enable_auto_tool_choice=True, tool_call_parser=parser)
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0)
    s.close()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    yield from _tool_server(tmp_path_factory, "qwen3_moe", "qwen3", "qwen3", "hermes")


def _ask(i=0):
    return [{"role": "user", "content": f"weather in Oslo {i}?"}]


def _check_calls(calls):
    assert calls
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        assert jsonschema_rs.validator_for(SCHEMAS[c.function.name]).is_valid(
            json.loads(c.function.arguments)), c


def _streamed_calls(client, **kw):
    """The tool calls accumulated from a stream's deltas, and its finish reason."""
    calls, finish = {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        c = ch.choices[0]
        finish = c.finish_reason or finish
        for tc in c.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name  # id and name first
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_required_and_named_calls_validate(client):
    for i in range(3):
        r = client.chat.completions.create(model="tiny", messages=_ask(i), tools=TOOLS, n=4,
                                           tool_choice="required", temperature=1.0,
                                           max_tokens=200, parallel_tool_calls=False,
                                           extra_body=NO_THINK)
        for c in r.choices:
            assert c.finish_reason == "tool_calls"
            _check_calls(c.message.tool_calls)
    r = client.chat.completions.create(
        model="tiny", messages=_ask(), tools=TOOLS, n=4, temperature=1.0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "now"}}, extra_body=NO_THINK)
    for c in r.choices:
        assert [t.function.name for t in c.message.tool_calls] == ["now"]
        _check_calls(c.message.tool_calls)


def test_streamed_calls_equal_the_non_streamed(client):
    kw = dict(model="tiny", messages=_ask(), tools=TOOLS, tool_choice="required",
              temperature=0, max_tokens=200, parallel_tool_calls=False, extra_body=NO_THINK)
    whole = client.chat.completions.create(**kw).choices[0]
    got, finish = _streamed_calls(client, **kw)
    assert got == [[t.function.name, t.function.arguments] for t in whole.message.tool_calls]
    assert finish == whole.finish_reason == "tool_calls"


def test_auto_reads_the_hermes_format_and_reasoning(client):
    """The model's text forced (a choice grammar over the whole output, think block too) to a
    think block then a hermes call."""
    text = "<think>check the clock</think>" + HERMES
    kw = dict(model="tiny", messages=_ask(), tools=TOOLS, temperature=0, max_tokens=80,
              extra_body={"structured_outputs": {"choice": [text], "start_after": None}})
    m = client.chat.completions.create(**kw).choices[0]
    assert m.finish_reason == "tool_calls"
    assert m.message.reasoning_content == "check the clock"
    assert [(t.function.name, json.loads(t.function.arguments))
            for t in m.message.tool_calls] == [("now", {"tz": "CET"})]
    got, finish = _streamed_calls(client, **kw)
    assert got == [["now", m.message.tool_calls[0].function.arguments]]
    assert finish == "tool_calls"
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                        for ch in client.chat.completions.create(stream=True, **kw)
                        if ch.choices)
    assert reasoning == "check the clock"


def test_reasoning_content_and_tool_results(client):
    msgs = _ask() + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    kw = dict(model="tiny", messages=msgs, tools=TOOLS, tool_choice="none", temperature=0,
              max_tokens=40, extra_body={"structured_outputs": {"choice": [
                  "<think>it is cold</think>Wear a coat."], "start_after": None},
                  "chat_template_kwargs": {"enable_thinking": True}})
    m = client.chat.completions.create(**kw).choices[0].message
    assert (m.reasoning_content, m.content, m.tool_calls) == ("it is cold", "Wear a coat.", None)
    assert m.model_extra["reasoning"] == "it is cold"
    parts = [(getattr(ch.choices[0].delta, "reasoning_content", None) or "",
              ch.choices[0].delta.content or "")
             for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    assert "".join(p[0] for p in parts) == "it is cold"
    assert "".join(p[1] for p in parts) == "Wear a coat."


def test_bad_tools_and_choices_are_400s_naming_the_field(client):
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}]
    for kw, param in [(dict(tools=TOOLS, tool_choice={"type": "function",
                                                      "function": {"name": "nope"}}),
                       "tool_choice"),
                      (dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=bad_schema, tool_choice="required"), "tools.0.function"),
                      (dict(tools=TOOLS, tool_choice="required",
                            response_format={"type": "json_object"}), "tool_choice"),
                      (dict(tools=[{"type": "function", "function": {"name": "a b"}}]),
                       "tools"),
                      (dict(extra_body={"chat_template_kwargs": {"messages": []}}),
                       "chat_template_kwargs")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=_ask(), max_tokens=5, **kw)
        assert e.value.body["param"].startswith(param), (kw, e.value.body)


DS_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
           '```json\n{"city": "Lima", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


@pytest.fixture(scope="module")
def ds_client(tmp_path_factory):
    yield from _tool_server(tmp_path_factory, "deepseek_v3", "deepseek_v3", "deepseek_r1",
                            "deepseek_v3")


def test_deepseek_v3_tool_tokens_and_r1_reasoning(ds_client):
    """DeepSeek's template opens the think block (thinking=true); the model's text (forced)
    closes it and calls with DeepSeek-V3's tool-call tokens, which decode to their text."""
    text = "weather first</think>" + DS_CALL
    # the grammar lets the model spell a marker in bytes as well as take its token: room for it
    kw = dict(model="tiny", messages=_ask(), tools=TOOLS, temperature=0, max_tokens=400,
              extra_body={"structured_outputs": {"choice": [text], "start_after": None},
                          "chat_template_kwargs": {"thinking": True}})
    c = ds_client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.reasoning_content == "weather first"
    assert [(t.function.name, json.loads(t.function.arguments))
            for t in c.message.tool_calls] == [("get_weather", {"city": "Lima", "days": 2})]
    got, finish = _streamed_calls(ds_client, **kw)
    assert got == [["get_weather", c.message.tool_calls[0].function.arguments]]
    assert finish == "tool_calls"
    r = ds_client.chat.completions.create(model="tiny", messages=_ask(), tools=TOOLS,
                                          tool_choice="required", temperature=1.0, n=2,
                                          max_tokens=200, parallel_tool_calls=False)
    for ch in r.choices:  # thinking off: the template closes the block, the grammar holds all
        _check_calls(ch.message.tool_calls)
        assert getattr(ch.message, "reasoning_content", None) is None
