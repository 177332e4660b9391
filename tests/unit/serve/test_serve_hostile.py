"""megainfer-serve under hostile and careless input (single mode, a real uvicorn server): every
refusal an OpenAI-shaped 4xx naming the culprit, work bounded per request (n, queue cost),
bodies bounded and read only once the key is checked, slow clients cut off, a bug's 500 shaped
and the connection kept; after each abusive request a normal greedy request returns the same
text as before and /health is 200."""
import json
import re
import socket
import time

import httpx
import openai
import pytest

from serve_util import CHAT_TEMPLATE, ThreadServer, post_json

KW = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=200,
          block_size=4)
KEY = "k"
H = {"Authorization": f"Bearer {KEY}"}
LIMITS = dict(max_n=8, max_body_bytes=64 * 1024, header_timeout_s=0.5, body_timeout_s=0.5,
              max_queued_requests=12)
NORMAL = {"prompt": "abcdef", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def srv(tiny_ckpts):
    s = ThreadServer(tiny_ckpts[("qwen3_moe", "base")], llm_kw=KW, api_key=KEY,
                     chat_template=CHAT_TEMPLATE, **LIMITS)
    s.normal = httpx.post(s.url + "/v1/completions", json=NORMAL, headers=H,
                          timeout=30).json()["choices"][0]["text"]
    yield s
    s.close()


def post(srv, body, path="/v1/completions", headers=H, client=httpx, **kw):
    return post_json(srv.url, body, headers, path, client, **kw)


def err(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    assert e["code"] is None or isinstance(e["code"], str), e
    assert e["type"] in ("invalid_request_error", "authentication_error", "not_found_error",
                         "service_unavailable_error", "server_error"), e
    if param is not None:
        assert e["param"] == param, e
    if code is not None:
        assert e["code"] == code, e
    return e


def still_serves(srv):
    assert httpx.get(srv.url + "/health").status_code == 200
    r = post(srv, NORMAL)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == srv.normal


def test_n_is_bounded_and_admission_counts_samples(srv):
    err(post(srv, {"prompt": "Hi", "n": 20000, "max_tokens": 1}), 400, "n")
    err(post(srv, {"prompt": "Hi", "n": 299020541509, "max_tokens": 1}), 400, "n")
    err(post(srv, {"prompt": "Hi", "n": 2, "best_of": 9, "max_tokens": 1}), 400, "best_of")
    err(post(srv, {"messages": [{"role": "user", "content": "x"}], "n": 9},
              "/v1/chat/completions"), 400, "n")
    # 2 prompts x n=8 = 16 sequences: more than serve.max_queued_requests=12 can ever hold
    e = err(post(srv, {"prompt": ["a", "b"], "n": 8, "max_tokens": 1}), 400,
            code="request_too_large")
    assert "max_queued_requests=12" in e["message"]
    t0 = time.monotonic()
    r = post(srv, {"prompt": "Hi", "n": 8, "max_tokens": 3, "temperature": 1, "seed": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8  # n at the limit
    assert time.monotonic() - t0 < 20
    m = httpx.get(srv.url + "/metrics", headers=H).text  # every iteration under 2.5 s
    under = float(re.search(r'iteration_time_seconds_bucket\{le="2.5"[^}]*\} (\S+)', m).group(1))
    assert under == float(re.search(r"iteration_time_seconds_count\{[^}]*\} (\S+)", m).group(1))
    still_serves(srv)


def test_admission_counts_prompt_tokens(tiny_ckpts, monkeypatch):
    s = ThreadServer(tiny_ckpts[("qwen3_moe", "base")], llm_kw=KW, max_queued_tokens=40)
    try:
        slow_steps(s, monkeypatch)
        e = err(post(s, {"prompt": ["x" * 30, "y" * 30], "max_tokens": 1}, headers={}), 400,
                code="request_too_large")  # 60 prompt tokens: more than 40 on its own
        assert "max_queued_tokens=40" in e["message"]
        c = s.client
        c.tokens_queued = 30  # prompts admitted and not yet prefilled
        r = post(s, {"prompt": "x" * 20, "max_tokens": 1}, headers={})
        assert err(r, 503, code="queue_full") and r.headers["retry-after"] == "1"
        c.tokens_queued = 0
        assert post(s, {"prompt": "x" * 20, "max_tokens": 1}, headers={}).status_code == 200
        assert c.tokens_queued == 0 and c.seqs_in_flight == 0 and not c.live
    finally:
        s.close()


def test_the_metrics_label_shows_no_model_path_unless_asked():
    from megainfer.config import ServeConfig
    from megainfer.serve.server import metrics_label
    assert metrics_label(ServeConfig(), "/srv/models/qwen3", "/srv/models/qwen3") == "qwen3"
    assert metrics_label(ServeConfig(served_model_name="/srv/x"), "/srv/x", "/srv/m") == "/srv/x"
    assert metrics_label(ServeConfig(), "megainfer-mixtral", None) == "megainfer-mixtral"


def test_text_that_utf8_cannot_encode_is_400_and_the_connection_stays(srv):
    with httpx.Client(timeout=30) as c:
        for path, body, param in (
                ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
                ("/v1/completions", '{"prompt": ["ok", "a\\udfffb"]}', "prompt"),
                ("/v1/chat/completions", '{"messages": [{"role": "user", "content": '
                 '"a\\ud800"}]}', "messages"),
                ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a", '
                 '"name": "\\ud800"}]}', "messages"),
                ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
                ("/v1/completions", '{"prompt": "a", "stop": ["\\ud800"]}', "stop")):
            e = err(post(srv, body, path, client=c), 400)
            assert e["param"].split(".")[0] == param, e
        r = post(srv, NORMAL, client=c)  # the same keep-alive connection
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == srv.normal
    still_serves(srv)


def test_values_out_of_range_and_lax_types_are_400_naming_the_field(srv):
    for body, param in (('{"prompt": "a", "temperature": Infinity}', "temperature"),
                        ('{"prompt": "a", "top_p": NaN}', "top_p"),
                        ('{"prompt": "a", "presence_penalty": -Infinity}', "presence_penalty"),
                        ({"prompt": [[False]]}, "prompt"), ({"prompt": ["1", 2]}, "prompt"),
                        ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
                        ({"prompt": "a", "n": True}, "n"), ({"prompt": "a", "echo": 1}, "echo"),
                        ({"prompt": "a", "request_id": "r" * 20_000}, "request_id"),
                        ({"prompt": "a", "user": "u" * 300}, "user"),
                        ({"prompt": "a", "stop": ["s"] * 33}, "stop"),
                        ({"prompt": "a", "stop": "s" * 600}, "stop"),
                        ({"prompt": "a", "logit_bias": {str(i): 1 for i in range(1100)}},
                         "logit_bias")):
        r = post(srv, body)
        e = err(r, 400)
        assert e["param"].split(".")[0] == param, (body if isinstance(body, str) else param, e)
        assert len(r.content) < 4096  # a 20 kB request_id is not echoed back
    still_serves(srv)


def test_bodies_are_bounded_and_the_key_checked_before_the_body(srv):
    big = json.dumps({"prompt": "x" * (70 * 1024)})
    err(post(srv, big), 413, code="request_too_large")
    chunks = (b"x" * 8192 for _ in range(10))  # no Content-Length: counted while read
    r = httpx.post(srv.url + "/v1/completions", content=chunks, headers={
        **H, "content-type": "application/json"}, timeout=30)
    err(r, 413)
    r = post(srv, b"{not json", headers={})  # no key: 401 whatever the body
    e = err(r, 401, code="invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    with socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 300000000\r\n\r\n")  # 300 MB announced, none sent
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 401")  # answered without reading it
    still_serves(srv)


def test_slow_clients_are_cut_off(srv):
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # stops inside the headers
        s.settimeout(5)
        t0 = time.monotonic()
        assert s.recv(4096) == b""  # closed by the server
        assert time.monotonic() - t0 < 3
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nAuthorization: Bearer k\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 408")  # it paused inside its body
    still_serves(srv)


def test_long_inputs_are_refused_early_and_never_freeze_the_loop(srv):
    e = err(post(srv, {"prompt": "x" * 60_000}), 400, "prompt")
    assert "max_model_len=128" in e["message"]
    err(post(srv, {"prompt": "x" * 60_000}, "/tokenize"), 400, "prompt")
    err(post(srv, {"tokens": [1] * 200}, "/detokenize"), 400, "tokens")
    t = post(srv, {"prompt": "x" * 100}, "/tokenize").json()
    assert t["count"] == 100


def slow_steps(srv, monkeypatch, s=0.05):
    """Each engine iteration takes at least ``s`` (the tiny model is too fast to catch)."""
    eng = srv.llm.engine
    step = eng.step_outputs

    def slow():
        time.sleep(s)
        return step()
    monkeypatch.setattr(eng, "step_outputs", slow)


def test_duplicate_request_id_is_400_streamed_or_not(srv, monkeypatch):
    slow_steps(srv, monkeypatch)
    body = {"prompt": "abc", "max_tokens": 100, "ignore_eos": True, "stream": True,
            "request_id": "dup"}
    with httpx.Client(timeout=30) as a:
        with a.stream("POST", srv.url + "/v1/completions", json=body, headers=H) as r1:
            lines = r1.iter_lines()  # kept: closing it would hang up
            next(x for x in lines if x.startswith("data:"))
            err(post(srv, body), 400, "request_id")
            err(post(srv, {**body, "stream": False}), 400, "request_id")
    still_serves(srv)


def test_a_bug_is_an_openai_shaped_500_and_the_connection_stays(srv, monkeypatch):
    from megainfer.serve.serving_tokens import TokenServing

    def boom(self, body):
        raise KeyError("a bug")
    monkeypatch.setattr(TokenServing, "detokenize", boom)
    with httpx.Client(timeout=30) as c:
        e = err(post(srv, {"tokens": [1]}, "/detokenize", client=c), 500, code="internal_error")
        assert "logged as err-" in e["message"]
        monkeypatch.undo()
        assert post(srv, {"tokens": [104, 105]}, "/detokenize", client=c).json() == \
            {"prompt": "hi"}


def test_every_documented_field_through_the_openai_client(srv):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    r = c.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0, n=2, top_p=0.9, seed=1, stop=["zz"],
                             presence_penalty=0.1, frequency_penalty=0.1, user="u",
                             logit_bias={"5": -100}, logprobs=2, echo=True,
                             stream_options=None, best_of=2,
                             extra_body={"min_tokens": 6, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1,
                                         "ignore_eos": True, "stop_token_ids": [7],
                                         "skip_special_tokens": False,
                                         "include_stop_str_in_output": True,
                                         "prompt_logprobs": 1, "request_id": "all-fields"})
    assert len(r.choices) == 2 and all(len(ch.logprobs.tokens) >= 3 + 6 for ch in r.choices)
    assert r.choices[0].text.startswith("abc")
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                  max_completion_tokens=4, logprobs=True, top_logprobs=2,
                                  temperature=0, extra_body={"min_tokens": 3,
                                                             "add_generation_prompt": True})
    assert len(r.choices[0].logprobs.content) >= 3
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3
    chunks = list(c.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True, "stream_options": {
                                           "include_usage": True,
                                           "continuous_usage_stats": True}}))
    assert chunks[-1].usage.completion_tokens == 4 and chunks[0].usage is not None
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")


def test_echo_with_max_tokens_0_and_the_first_prompt_token(srv):
    r = post(srv, {"prompt": "abc", "echo": True, "max_tokens": 0}).json()
    ch = r["choices"][0]
    assert ch["text"] == "abc" and ch["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0
    r = post(srv, {"prompt": "abc", "echo": True, "max_tokens": 0, "logprobs": 1}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"] and lp["token_logprobs"][0] is None
    assert lp["text_offset"] == [0, 1, 2] and lp["token_logprobs"][1] is not None
    r = post(srv, {"prompt": "abc", "echo": True, "max_tokens": 2, "logprobs": 0,
                   "temperature": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"][:3] == ["a", "b", "c"] and lp["text_offset"][:4] == [0, 1, 2, 3]
    with httpx.stream("POST", srv.url + "/v1/completions", headers=H, json={
            "prompt": "abc", "echo": True, "max_tokens": 0, "stream": True}) as r:
        ev = [x for x in r.iter_lines() if x.startswith("data:")]
    assert json.loads(ev[0][5:])["choices"][0]["text"] == "abc" and ev[-1] == "data: [DONE]"


def test_metrics_need_the_key_and_the_document_tells_the_truth(srv):
    r = httpx.get(srv.url + "/metrics")
    err(r, 401)
    m = httpx.get(srv.url + "/metrics", headers=H)
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    assert httpx.get(srv.url + "/health").headers["content-type"].startswith("text/plain")
    doc = httpx.get(srv.url + "/openapi.json").json()
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http",
                                                              "scheme": "bearer"}
    op = doc["paths"]["/v1/completions"]["post"]
    assert op["security"] == [{"bearer": []}] and "422" not in op["responses"]
    assert {"400", "401", "404", "413", "503"} <= set(op["responses"])
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert "text/plain" in doc["paths"]["/health"]["get"]["responses"]["200"]["content"]
    assert "security" not in doc["paths"]["/health"]["get"]


def test_hang_up_of_a_non_streamed_request_logs_no_error(srv, monkeypatch, caplog):
    import logging
    slow_steps(srv, monkeypatch)
    eng = srv.llm.engine
    uv = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not reach the root one
    uv.addHandler(caplog.handler)
    monkeypatch.setattr(uv, "handlers", uv.handlers)  # removed again after the test
    with caplog.at_level("WARNING"):
        with pytest.raises(httpx.ReadTimeout):
            post(srv, {"prompt": "abc", "max_tokens": 100, "ignore_eos": True}, timeout=0.3)
        t0 = time.monotonic()
        while eng.requests and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        time.sleep(0.3)
    assert not eng.requests  # aborted
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], \
        [r.getMessage() for r in caplog.records]


def test_when_the_grace_runs_out_streams_end_properly_and_the_rest_get_503(tiny_ckpts):
    import threading
    s = ThreadServer(tiny_ckpts[("qwen3_moe", "base")], llm_kw=KW, shutdown_grace_s=0.3)
    eng = s.llm.engine
    step = eng.step_outputs

    def slow():
        time.sleep(0.05)
        return step()
    eng.step_outputs = slow
    body = {"prompt": "abc", "max_tokens": 120, "ignore_eos": True}
    res = {}

    def whole():
        res["whole"] = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
    t = threading.Thread(target=whole)
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            next(x for x in lines if x.startswith("data:"))
            t.start()
            time.sleep(0.2)
            s.server.should_exit = True  # what SIGTERM does (DrainingServer.on_signal)
            rest = [x for x in lines if x.startswith("data:")]
        t.join(30)
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][5:])
        assert last["choices"][0]["finish_reason"] == "abort"
        err(res["whole"], 503, code="shutting_down")
        s.thread.join(30)
        assert not s.thread.is_alive()
    finally:
        s.close()
