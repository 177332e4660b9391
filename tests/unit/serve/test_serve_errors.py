"""megainfer-serve's refusals, each OpenAI-shaped and answered without disturbing the others:
malformed JSON and bad fields (400 naming the field), unknown model (404), a prompt longer than
max_model_len (400), a missing or wrong API key (401), a full queue (503 + Retry-After); and a
client that hangs up mid-stream aborting its request (the running gauge back to 0, its blocks
freed)."""
import re
import time

import httpx
import openai
import pytest

from serve_util import ThreadServer

KW = dict(max_model_len=512, max_num_seqs=1, max_num_batched_tokens=32, num_blocks=300,
          block_size=4)
KEY = "k"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv(tiny_ckpts):
    s = ThreadServer(tiny_ckpts[("qwen3_moe", "base")], llm_kw=KW, api_key=KEY,
                     max_queued_requests=1)
    yield s
    s.close()


def _err(r, status, param=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if param is not None:
        assert e["param"] == param, e
    return e


def post(srv, body, path="/v1/completions", headers=H, **kw):
    kw.setdefault("timeout", 30)
    return httpx.post(srv.url + path, json=body, headers=headers, **kw)


def test_bad_input_is_400_naming_the_field(srv):
    r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "a",', headers={
        **H, "content-type": "application/json"})
    assert "malformed JSON" in _err(r, 400)["message"]
    _err(post(srv, {"prompt": "a", "temperature": -1}), 400, "temperature")
    _err(post(srv, {"prompt": "a", "max_tokens": "many"}), 400, "max_tokens")
    _err(post(srv, {"prompt": "a", "temprature": 0}), 400, "temprature")
    _err(post(srv, {"prompt": "a", "top_p": 0}), 400, "top_p")
    _err(post(srv, {"prompt": [999999]}), 400, "prompt")
    _err(post(srv, {"messages": []}, "/v1/chat/completions"), 400, "messages")
    _err(post(srv, {"messages": [{"role": "user", "content": "x"}]}, "/v1/chat/completions"),
         400, "messages")  # no chat template: the request cannot name one either
    _err(post(srv, {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"},
              "/v1/chat/completions"), 400, "chat_template")
    _err(post(srv, {"prompt": "a", "logit_bias": {"x": 1}}), 400, "logit_bias")
    _err(post(srv, {"prompt": "a", "logit_bias": {"-3": 1}}), 400, "logit_bias")
    _err(post(srv, {"prompt": "a", "logit_bias": {"999999": 1}}), 400, "logit_bias")


def test_unknown_model_404_and_too_long_400(srv):
    _err(post(srv, {"model": "gpt-9", "prompt": "a"}), 404, "model")
    e = _err(post(srv, {"prompt": "x" * 513}), 400, "prompt")
    assert "max_model_len=512" in e["message"]
    _err(post(srv, {"prompt": "x" * 508, "max_tokens": 10}), 400, "max_tokens")
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="a")
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x" * 513)
    assert c.completions.create(model="tiny", prompt="ok", max_tokens=2).choices  # still serves


def test_api_key_401(srv):
    _err(post(srv, {"prompt": "a"}, headers={}), 401)
    _err(post(srv, {"prompt": "a"}, headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(srv.url + "/health").status_code == 200  # open without the key


def _gauge(srv, name):
    m = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(re.search(rf"^megainfer:{name}\{{[^}}]*\}} (\S+)$", m, re.M).group(1))


def _wait(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout
        time.sleep(0.02)


def test_queue_full_503_and_hang_up_frees_the_request(srv):
    eng = srv.llm.engine
    body = {"prompt": "abc", "max_tokens": 500, "ignore_eos": True, "stream": True}
    generated = _gauge(srv, "generation_tokens_total")
    with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b:
        with a.stream("POST", srv.url + "/v1/completions", json=body, headers=H) as r1:
            lines = r1.iter_lines()
            next(x for x in lines if x.startswith("data:"))  # running (max_num_seqs=1)
            with b.stream("POST", srv.url + "/v1/completions", json=body, headers=H) as r2:
                _wait(lambda: _gauge(srv, "num_requests_waiting") == 1)  # the one queue place
                r3 = post(srv, {"prompt": "abc", "max_tokens": 2})
                e = _err(r3, 503)
                assert r3.headers["retry-after"] == "1" and "queue full" in e["message"]
                assert r2.status_code == 200
        # both clients hung up mid-stream: their requests are aborted, blocks freed
    _wait(lambda: _gauge(srv, "num_requests_running") == 0
          and _gauge(srv, "num_requests_waiting") == 0)
    _wait(lambda: not eng.requests and eng.blocks.num_free_blocks == eng.blocks.num_blocks)
    assert _gauge(srv, "generation_tokens_total") - generated < 500  # cut short, not finished
    assert post(srv, {"prompt": "abc", "max_tokens": 2}).status_code == 200


def test_hang_up_of_a_non_streamed_request_aborts_it(srv):
    eng = srv.llm.engine
    generated = _gauge(srv, "generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        post(srv, {"prompt": "abc", "max_tokens": 500, "ignore_eos": True}, timeout=0.5)
    _wait(lambda: not eng.requests and _gauge(srv, "num_requests_running") == 0)
    assert _gauge(srv, "generation_tokens_total") - generated < 500
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_draining_health_503_and_new_requests_refused(srv):
    srv.client.draining = True
    try:
        assert httpx.get(srv.url + "/health").status_code == 503
        r = post(srv, {"prompt": "abc", "max_tokens": 2})
        assert _err(r, 503)["code"] == "shutting_down" and r.headers["retry-after"] == "1"
    finally:
        srv.client.draining = False
    assert httpx.get(srv.url + "/health").status_code == 200
