"""megainfer-serve through the official openai client against a real uvicorn server on
127.0.0.1: greedy completions and chat equal to LLM.generate / LLM.chat, streamed and not
(chunks concatenated = the non-streamed text, usage), 32 concurrent streams, logprobs, n, stop,
echo, the other endpoints and the metrics."""
import asyncio

import httpx
import openai
import pytest

from megainfer import LLM, SamplingParams
from serve_util import CHAT_TEMPLATE, ThreadServer

KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=160,
          block_size=4)
KEY = "test-key"
PROMPTS = [("abcdefghij" * 3)[: 3 + i] for i in range(32)]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpts):
    return tiny_ckpts[("qwen3_moe", "base")]


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, **KW)


@pytest.fixture(scope="module")
def srv(ckpt):
    s = ThreadServer(ckpt, llm_kw=KW, api_key=KEY, chat_template=CHAT_TEMPLATE)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n)


def test_completions_greedy_equal_llm_generate(client, offline):
    want = offline.generate(PROMPTS[:3], _greedy(10), use_tqdm=False)
    r = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=10, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == \
        [o.outputs[0].text for o in want]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in want)
    ids = want[0].prompt_token_ids  # token ids as the prompt: the same text
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == want[0].outputs[0].text
    assert r.choices[0].finish_reason == want[0].outputs[0].finish_reason


def test_completions_stream_concatenates_to_the_text(client):
    kw = dict(model="tiny", prompt=PROMPTS[7], max_tokens=20, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens


def test_stream_ends_with_done(srv):
    with httpx.stream("POST", srv.url + "/v1/completions", headers={"Authorization":
                      f"Bearer {KEY}"}, json={"prompt": "abc", "max_tokens": 3,
                                              "stream": True}) as r:
        lines = [x for x in r.iter_lines() if x]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)


def test_chat_equal_llm_chat_streamed_and_not(client, offline):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    want = offline.chat(msgs, _greedy(12), use_tqdm=False, chat_template=CHAT_TEMPLATE)[0]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=12,
                                       temperature=0)
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)


def test_32_concurrent_streams_equal_llm_generate(srv, offline):
    want = offline.generate(PROMPTS, [_greedy(4 + i % 9) for i in range(32)], use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)

    async def one(i):
        s = await aclient.completions.create(model="tiny", prompt=PROMPTS[i], temperature=0,
                                             max_tokens=4 + i % 9, stream=True)
        return "".join([c.choices[0].text async for c in s if c.choices])

    async def main():
        try:
            return await asyncio.gather(*[one(i) for i in range(32)])
        finally:
            await aclient.close()
    assert asyncio.run(main()) == [o.outputs[0].text for o in want]


def test_logprobs_n_seed_stop_echo(client, offline):
    want = offline.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=6, logprobs=2),
                            use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=6, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([p[t].logprob for p, t in
                                               zip(want.logprobs, want.token_ids)], abs=1e-5)
    # keyed by token text (OpenAI's shape): ids >= 256 all decode to "" with the byte tokenizer
    assert all(1 <= len(d) <= 2 for d in lp.top_logprobs)
    assert [max(d.values()) for d in lp.top_logprobs] == pytest.approx(
        [max(e.logprob for e in p.values() if e.rank == 1) for p in want.logprobs], abs=1e-5)
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    assert len(c.choices[0].logprobs.content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in c.choices[0].logprobs.content)
    kw = dict(model="tiny", prompt=PROMPTS[9], max_tokens=8, temperature=0.9, seed=11, n=2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert len(a.choices) == 2 and [x.text for x in a.choices] == [x.text for x in b.choices]
    texts = ["", ""]
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [x.text for x in sorted(a.choices, key=lambda c: c.index)]
    e = client.completions.create(model="tiny", prompt="abcd", max_tokens=3, temperature=0,
                                  echo=True)
    plain = client.completions.create(model="tiny", prompt="abcd", max_tokens=3, temperature=0)
    assert e.choices[0].text == "abcd" + plain.choices[0].text
    full = offline.generate(PROMPTS[14], _greedy(12), use_tqdm=False)[0].outputs[0].text
    stop = next((full[k:k + 2] for k in range(1, len(full) - 1) if full[k:k + 2].isprintable()
                 and full[k:k + 2].isascii()), None)
    if stop is not None:
        s = client.completions.create(model="tiny", prompt=PROMPTS[14], max_tokens=12,
                                      temperature=0, stop=[stop])
        assert s.choices[0].text == full[:full.index(stop)]
        assert s.choices[0].finish_reason == "stop"


def test_logit_bias_forces_and_bans_tokens_as_llm_generate_does(client, offline):
    """skip_special_tokens=false is served; OpenAI's logit_bias ({"id": bias}, clamped to [-100, 100] as vLLM does): +100 on a
    token makes every greedy token that one; the same bias through LLM.generate gives the same
    tokens, streamed too; -100 on the unbiased argmax bans it."""
    plain = offline.generate(PROMPTS[4], _greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    force = {str(plain[0] + 1): 250}  # clamped to 100
    r = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=6, temperature=0,
                                  logit_bias=force)
    want = offline.generate(PROMPTS[4], SamplingParams(temperature=0, max_tokens=6,
                                                       logit_bias={plain[0] + 1: 100}),
                            use_tqdm=False)[0].outputs[0]
    assert want.token_ids == [plain[0] + 1] * 6 and r.choices[0].text == want.text
    assert r.usage.completion_tokens == 6
    banned = offline.generate(PROMPTS[4], SamplingParams(temperature=0, max_tokens=1,
                                                         logit_bias={plain[0]: -100}),
                              use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != plain[0]
    s = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=1, temperature=0,
                                  logit_bias={str(plain[0]): -100}, stream=True)
    assert "".join(c.choices[0].text for c in s if c.choices) == banned.text
    kept = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=6, temperature=0,
                                     extra_body={"skip_special_tokens": False})
    assert kept.choices[0].text == offline.generate(  # byte tokens: no special text either way
        PROMPTS[4], SamplingParams(temperature=0, max_tokens=6, skip_special_tokens=False),
        use_tqdm=False)[0].outputs[0].text


def test_prompt_logprobs_equal_llm_generate(client, offline):
    """vLLM's prompt_logprobs: per prompt token (null for the first) the token's logprob, rank
    and text plus the top k, as LLM.generate gives them; in chat beside the choices; refused
    with stream."""
    want = offline.generate(PROMPTS[9], SamplingParams(temperature=0, max_tokens=2,
                                                       prompt_logprobs=2), use_tqdm=False)[0]
    r = client.completions.create(model="tiny", prompt=PROMPTS[9], max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(want.prompt_token_ids) and got[0] is None
    for g, w, tok in zip(got[1:], want.prompt_logprobs[1:], want.prompt_token_ids[1:]):
        assert str(tok) in g and set(g) == {str(t) for t in w}
        for t, e in w.items():
            assert g[str(t)]["logprob"] == pytest.approx(e.logprob, abs=1e-5)
            assert g[str(t)]["rank"] == e.rank and g[str(t)]["decoded_token"] == e.decoded_token
    e = client.completions.create(model="tiny", prompt=PROMPTS[9], max_tokens=2, echo=True,
                                  logprobs=1, temperature=0, extra_body={"prompt_logprobs": 3})
    assert len(e.choices[0].model_extra["prompt_logprobs"][1]) >= 3  # both asks served
    assert e.choices[0].logprobs.top_logprobs[0] is None
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                   "content": "hi"}],
                                          max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    assert chat.model_extra["prompt_logprobs"][0] is None
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt="ab", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def test_models_tokenize_detokenize_health_version_metrics(srv, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    h = {"Authorization": f"Bearer {KEY}"}
    t = httpx.post(srv.url + "/tokenize", json={"prompt": "hi"}, headers=h).json()
    assert t["tokens"] == list(b"hi") and t["count"] == 2
    d = httpx.post(srv.url + "/detokenize", json={"tokens": t["tokens"]}, headers=h).json()
    assert d["prompt"] == "hi"
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/version").json()["version"]
    m = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "iteration_time_seconds_bucket"):
        assert f"megainfer:{name}" in m, name
    assert 'finished_reason="length"' in m
