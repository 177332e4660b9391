"""``mpiexec -n K megainfer-serve deploy=...`` (the frontend on rank 0) and a plain
``megainfer-serve deploy=...`` (the frontend a process of its own, the ranks its child job)
through the official openai client: the
disaggregated (a1e2) and PD (p1a1e2) runtimes served either way give the greedy completions and
chat that ``LLM.generate`` / ``LLM.chat`` give in single mode, streamed (chunks concatenated) and
not, with concurrent streams; a client that hangs up frees its request (running gauge back to
0); PD's KV-transfer histogram fills, rank 0's T_a one with tracing on; SIGTERM to mpiexec drains and leaves no process. A rank
that hangs (SIGSTOP) turns /health 503, ends the in-flight stream with an error event and the
job exits non-zero naming the rank; under mpiexec, a rank killed outright ends the job at once
(MPICH's process manager kills every rank), leaving no process; behind a plain frontend, the
frontend outlives it: /health 503, the in-flight stream ends with an error event, and the
server exits non-zero naming the rank."""
import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from megainfer import LLM, SamplingParams
from serve_util import CHAT_TEMPLATE, MpiServe, gauge, wait_for

KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, num_blocks=160,
          block_size=4)
OVERRIDES = ["scheduler.max_model_len=128", "scheduler.max_num_seqs=8",
             "scheduler.max_num_batched_tokens=32", "cache.num_blocks=160", "cache.block_size=4"]
PROMPTS = [("abcdefghij" * 4)[: 3 + 3 * i] for i in range(8)]
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "bc"]},
                                           "v": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["k", "v"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ckpt(tiny_ckpts):
    return tiny_ckpts[("mixtral", "base")]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    p = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    p.write_text(CHAT_TEMPLATE)
    return str(p)


@pytest.fixture(scope="module")
def want(ckpt):
    llm = LLM(ckpt, **KW)
    return {"text": [o.outputs[0].text for o in llm.generate(
                PROMPTS, [SamplingParams(temperature=0, max_tokens=4 + i) for i in range(8)],
                use_tqdm=False)],
            "chat": llm.chat(MSGS, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False,
                             chat_template=CHAT_TEMPLATE)[0].outputs[0].text,
            "json": llm.chat(MSGS, SamplingParams(temperature=0, max_tokens=40,
                                                  structured_outputs={"json": SCHEMA}),
                             use_tqdm=False, chat_template=CHAT_TEMPLATE)[0].outputs[0].text}


def _start(ranks, ckpt, deploy, *extra, plain=False):
    """``plain``: a plain megainfer-serve process (its engine core a child job of ``ranks``)."""
    return MpiServe(None if plain else ranks, [f"deploy={deploy}", f"model.path={ckpt}",
                                               "serve.served_model_name=tiny", *OVERRIDES,
                                               *extra])


async def _streams(url, n):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def one(i):
        s = await client.completions.create(model="tiny", prompt=PROMPTS[i], temperature=0,
                                            max_tokens=4 + i, stream=True)
        return "".join([c.choices[0].text async for c in s if c.choices])
    try:
        return await asyncio.gather(*[one(i) for i in range(n)])
    finally:
        await client.close()


@pytest.mark.parametrize("ranks,deploy,trace,plain", [
    (3, "a1e2", False, False), (4, "p1a1e2", False, False), (3, "a1e2", True, True),
    (4, "p1a1e2", False, True)], ids=["a1e2", "p1a1e2", "a1e2-plain", "p1a1e2-plain"])
def test_served_mode_equals_single_mode(ckpt, template, want, ranks, deploy, trace, plain):
    srv = _start(ranks, ckpt, deploy, f"serve.chat_template={template}",
                 f"trace.enabled={str(trace).lower()}", plain=plain)
    try:
        url = srv.url
        assert httpx.get(url + "/health").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=4,
                                      temperature=0)
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)][0] == want["text"][0]
        r = client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=9,
                                      temperature=0)
        assert r.choices[0].text == want["text"][5] and r.usage.completion_tokens == 9
        chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=9,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want["text"][5]
        c = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=10,
                                           temperature=0)
        assert c.choices[0].message.content == want["chat"]
        chunks = list(client.chat.completions.create(model="tiny", messages=MSGS,
                                                     max_tokens=10, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            want["chat"]
        fmt = {"type": "json_schema", "json_schema": {"name": "kv", "schema": SCHEMA}}
        c = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=40,
                                           temperature=0, response_format=fmt)
        assert c.choices[0].message.content == want["json"]  # the ranks' grammar, as single's
        assert json.loads(want["json"])["k"] in ("a", "bc")
        assert asyncio.run(_streams(url, 8)) == want["text"]  # 8 at once share the batch
        # a client that hangs up mid-stream: its request is aborted on its replica
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 120, "ignore_eos": True,
                "stream": True}
        generated = gauge(url, "generation_tokens_total")
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
            lines = s.iter_lines()
            next(x for x in lines if x.startswith("data:"))
            wait_for(lambda: gauge(url, "num_requests_running") == 1, 20, "running")
        wait_for(lambda: gauge(url, "num_requests_running") == 0
                 and gauge(url, "num_requests_waiting") == 0, 20, "aborted")
        assert gauge(url, "generation_tokens_total") - generated < 120  # cut short
        m = httpx.get(url + "/metrics").text
        role = "pd" if deploy == "p1a1e2" else "disaggregated"
        assert f'iteration_time_seconds_count{{model_name="tiny",role="{role}"}}' in m
        assert gauge(url, "request_queue_time_seconds_count") >= 12  # every finished request
        kv = gauge(url, "kv_transfer_seconds_count")
        assert (kv >= 12) if deploy == "p1a1e2" else kv == 0  # every PD request handed its KV
        t_a = gauge(url, "attention_layer_seconds_count")  # rank 0's T_a spans: tracing on
        assert (t_a > 0) if trace else t_a == 0
        spans = lambda: (gauge(url, "expert_layer_seconds_count"),  # noqa: E731 - T_e, and
                         gauge(url, "a2e_latency_seconds_count"))  # T_c: blocked expert waits
        if trace:  # the expert ranks report every few iterations, rank 0 takes what arrived
            wait_for(lambda: min(spans()) > 0, 10, f"T_e and T_c spans, got {spans()}")
        else:
            assert spans() == (0, 0)
        srv.signal(signal.SIGTERM)
        assert srv.wait(60) == 0, srv.output()
        wait_for(lambda: not srv.alive_pids(), 10, "every rank gone")
    finally:
        srv.close()


def _sse_events(url, body):
    """The data events of one streamed completion (consumed to the end)."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as s:
        return [x[6:] for x in s.iter_lines() if x.startswith("data: ")]


def _streaming(srv, extra=None):
    """Every rank up; one long stream running in a thread (its events in ``got["events"]``
    when it ends), its first tokens out."""
    url = srv.url
    assert httpx.get(url + "/health").status_code == 200 and set(srv.pids) == {0, 1, 2}
    got = {}
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 120, "ignore_eos": True,
            "stream": True, **(extra or {})}
    t = threading.Thread(target=lambda: got.update(events=_sse_events(url, body)))
    t.start()
    wait_for(lambda: gauge(url, "generation_tokens_total") >= 2, 30, "streaming")
    return t, got


@pytest.mark.parametrize("plain", [False, True], ids=["mpiexec", "plain"])
def test_a_hung_rank_turns_health_503_and_ends_the_job(ckpt, plain):
    srv = _start(3, ckpt, "a1e2", "comm.timeout_s=8", plain=plain)
    try:
        url = srv.url
        t, got = _streaming(srv, {"stream_options": {"include_usage": True}})
        os.kill(srv.pids[2], signal.SIGSTOP)  # expert 1 stops answering
        t0 = time.monotonic()
        wait_for(lambda: httpx.get(url + "/health").status_code == 503, 6, "health 503")
        rc = srv.wait(40)
        took = time.monotonic() - t0
        t.join(10)
        assert rc != 0 and took < 8 + 15, (rc, took)
        out = srv.output()
        assert "engine core died" in out and "peer rank 2" in out, out
        errors = [json.loads(e) for e in got["events"] if e.startswith("{\"error\"")]
        assert errors and got["events"][-1] == "[DONE]", got["events"][-3:]
        wait_for(lambda: not srv.alive_pids(), 10, "every rank gone")
    finally:
        srv.close()


def test_a_killed_rank_ends_the_job(ckpt):
    srv = _start(3, ckpt, "a1e2", "comm.timeout_s=8")
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        os.kill(srv.pids[1], signal.SIGKILL)
        assert srv.wait(20) != 0
        assert "BAD TERMINATION" in srv.output()  # MPICH's process manager ended the job
        wait_for(lambda: not srv.alive_pids(), 10, "every rank gone")
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health")
    finally:
        srv.close()


def test_a_killed_rank_behind_a_plain_frontend(ckpt):
    """SIGKILL of an expert rank takes the whole child job down at once; the frontend, not
    part of it, says so: /health 503, an error event ending the stream, exit 1 naming the
    rank, no process left."""
    srv = _start(3, ckpt, "a1e2", "comm.timeout_s=8", plain=True)
    try:
        url = srv.url
        t, got = _streaming(srv)
        os.kill(srv.pids[1], signal.SIGKILL)  # expert 0
        wait_for(lambda: _health(url) == 503, 10, "health 503")
        t.join(20)
        errors = [json.loads(e) for e in got["events"] if e.startswith("{\"error\"")]
        assert errors and got["events"][-1] == "[DONE]", got["events"][-3:]
        assert "rank 1" in errors[0]["error"]["message"], errors
        assert srv.wait(30) == 1
        out = srv.output()
        assert "engine core died" in out and "rank 1" in out and "[expert 0]" in out, out
        wait_for(lambda: not srv.alive_pids(), 10, "every process gone")
    finally:
        srv.close()


def _health(url) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0
