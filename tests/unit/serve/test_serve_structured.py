"""Structured outputs served, through the official openai client against a real server on a
random tiny model: response_format json_schema / json_object on chat and completions,
``chat.completions.parse`` with a pydantic model, vLLM's ``structured_outputs`` extra body
(regex, choice), streamed and not, and the typed 400s naming the field."""
import json
import re
from typing import Literal

import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

from serve_util import CHAT_TEMPLATE, ThreadServer

KW = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256, num_blocks=400,
          block_size=4)
KEY = "k"
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Oslo", "Lima", "Pune"]}, "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 999},
    "ok": {"type": "boolean"}}, "required": ["city", "n", "ok"], "additionalProperties": False}


class Answer(BaseModel):
    city: Literal["Oslo", "Lima"]
    rainy: bool
    score: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def client(tiny_ckpts):
    s = ThreadServer(tiny_ckpts[("qwen3_moe", "base")], llm_kw=KW, api_key=KEY,
                     chat_template=CHAT_TEMPLATE)
    yield openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)
    s.close()


def _msgs(i):
    return [{"role": "user", "content": f"weather {i}?"}]


def test_chat_json_schema_outputs_validate(client):
    valid = jsonschema_rs.validator_for(SCHEMA).is_valid
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                  "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=_msgs(0), n=8, max_tokens=80,
                                       temperature=1.0, response_format=fmt)
    assert len(r.choices) == 8
    for c in r.choices:
        assert c.finish_reason == "stop" and valid(json.loads(c.message.content)), c
    pieces = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="tiny", messages=_msgs(1), max_tokens=80, temperature=0, response_format=fmt,
        stream=True) if ch.choices]
    assert valid(json.loads("".join(pieces)))


def test_parse_with_a_pydantic_model(client):
    for i in range(4):
        r = client.chat.completions.parse(model="tiny", messages=_msgs(i), max_tokens=80,
                                          temperature=1.0, response_format=Answer)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Answer) and 0 <= parsed.score <= 9


def test_json_object_and_completions(client):
    r = client.chat.completions.create(model="tiny", messages=_msgs(2), max_tokens=120,
                                       temperature=0, response_format={"type": "json_object"})
    c = r.choices[0]
    assert c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict)
    valid = jsonschema_rs.validator_for(SCHEMA).is_valid
    r = client.completions.create(model="tiny", prompt=["a", "bb"], n=2, max_tokens=80,
                                  temperature=1.0, extra_body={"response_format": {
                                      "type": "json_schema",
                                      "json_schema": {"name": "w", "schema": SCHEMA}}})
    assert len(r.choices) == 4 and all(valid(json.loads(c.text)) for c in r.choices)


def test_vllm_structured_outputs_extra_body(client):
    r = client.completions.create(model="tiny", prompt="x", n=4, max_tokens=30, temperature=1,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-[ab]+"}})
    assert all(re.fullmatch(r"\d{3}-[ab]+", c.text) or c.finish_reason == "length"
               for c in r.choices)
    r = client.chat.completions.create(model="tiny", messages=_msgs(3), n=4, max_tokens=10,
                                       temperature=1, extra_body={"structured_outputs": {
                                           "choice": ["sunny", "rain"]}})
    assert {c.message.content for c in r.choices} <= {"sunny", "rain"}


def test_bad_specs_are_400s_naming_the_field(client):
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {
            "name": "w", "schema": {"type": "strin"}}}), "response_format",
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "yaml"}), "response_format", None),
        (dict(extra_body={"structured_outputs": {"grammar": "root ::= nope"}}),
         "structured_outputs", "does not compile"),
        (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}),
         "structured_outputs", "exactly one"),
        (dict(response_format={"type": "json_object"},
              extra_body={"structured_outputs": {"regex": "a"}}), "structured_outputs",
         "at most one"),
    ]
    for kw, param, text in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=_msgs(0), max_tokens=5, **kw)
        err = e.value.body
        assert err["param"].startswith(param), (kw, err)
        assert text is None or text in err["message"], (kw, err)
