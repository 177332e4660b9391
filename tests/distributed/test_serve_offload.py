"""``mpiexec -n 4 megainfer-serve deploy=p1a1e2 pd.offload=true pd.offload_ratio=1`` (and a
plain ``megainfer-serve``, the ranks its child job): the offload metrics on /metrics
(docs/serve.md, "Metrics (`GET /metrics`)"). While a long stream decodes,
``num_requests_offloaded`` is 1; after it, 0 again, ``offloaded_requests_total`` 1 and
``offload_round_trip_seconds`` holds one round trip per layer per token decoded on the decode
rank; concurrent streams are all offloaded (``ignore_eos``: none ends at its first token,
sampled on the prefill rank, so each decodes); every text is single mode's.

Why the request is offloaded for sure (``runtime/pd/offload_policy.py``): one sample, no prompt
logprobs, ratio 1 (every eligible one), and its whole life, ``min(prompt + max_tokens,
max_model_len)`` tokens, fits the prefill rank's pool (half of ``cache.num_blocks``: 160 blocks
of 4 tokens; the long stream needs 61, nothing else is in flight). It is offloaded from its
first token (sampled on the prefill rank) to its last; with ``ignore_eos`` that is 240 tokens,
several seconds even unloaded, while a poll of /metrics takes a fraction of one under load.
The wait for the gauge is bounded by the stream itself: a stream that ends first fails it,
saying whether the request was offloaded at all (the counter)."""
import asyncio
import json
import os
import signal
import threading

import httpx
import openai
import pytest

from megainfer import LLM, SamplingParams
from serve_util import MpiServe, gauge, wait_for

MML, BLOCKS, BS = 256, 320, 4
KW = dict(max_model_len=MML, max_num_seqs=8, max_num_batched_tokens=32, num_blocks=BLOCKS,
          block_size=BS)
OVERRIDES = [f"scheduler.max_model_len={MML}", "scheduler.max_num_seqs=8",
             "scheduler.max_num_batched_tokens=32", f"cache.num_blocks={BLOCKS}",
             f"cache.block_size={BS}", "pd.offload=true", "pd.offload_ratio=1"]
LONG = dict(prompt="abc", max_tokens=240)  # 3 + 240 tokens: 61 of the pool's 160 blocks
PROMPTS = [("abcdefghij" * 4)[: 3 + 3 * i] for i in range(4)]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpts):
    return tiny_ckpts[("mixtral", "base")]


@pytest.fixture(scope="module")
def want(ckpt):
    llm = LLM(ckpt, **KW)
    long_ = llm.generate([LONG["prompt"]], SamplingParams(
        temperature=0, max_tokens=LONG["max_tokens"], ignore_eos=True), use_tqdm=False)
    short = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=4 + i,
                                                  ignore_eos=True)
                                   for i in range(len(PROMPTS))], use_tqdm=False)
    return {"long": long_[0].outputs[0].text, "short": [o.outputs[0].text for o in short]}


def _num_layers(ckpt) -> int:
    with open(os.path.join(ckpt, "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


def _stream_in_thread(url):
    """The long stream in a thread; ``events``: its data events as they come."""
    events = []
    body = {"model": "tiny", "prompt": LONG["prompt"], "max_tokens": LONG["max_tokens"],
            "ignore_eos": True, "temperature": 0, "stream": True}

    def run():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as s:
            events.extend(x[6:] for x in s.iter_lines() if x.startswith("data: "))
    t = threading.Thread(target=run)
    t.start()
    return t, events


def _text(events) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events
                   if e != "[DONE]" and json.loads(e)["choices"])


async def _streams(url):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def one(i):
        s = await client.completions.create(model="tiny", prompt=PROMPTS[i], temperature=0,
                                            max_tokens=4 + i, stream=True,
                                            extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in s if c.choices])
    try:
        return await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])
    finally:
        await client.close()


@pytest.mark.parametrize("plain", [False, True], ids=["mpiexec", "plain"])
def test_offload_metrics_served(ckpt, want, plain):
    """``plain``: a plain megainfer-serve frontend, the ranks its child job (the figures cross
    its socket in ``CoreStats``)."""
    srv = MpiServe(None if plain else 4, ["deploy=p1a1e2", f"model.path={ckpt}", "serve.served_model_name=tiny",
                       *OVERRIDES])
    try:
        url = srv.url
        assert httpx.get(url + "/health").status_code == 200
        assert gauge(url, "num_requests_offloaded") == 0
        assert gauge(url, "offloaded_requests_total") == 0
        assert gauge(url, "num_requests_running") == gauge(url, "num_requests_waiting") == 0
        t, events = _stream_in_thread(url)
        seen = []  # the gauge's readings while the stream is in flight

        def offloaded_or_over():
            seen.append(gauge(url, "num_requests_offloaded"))
            return seen[-1] == 1 or not t.is_alive()
        wait_for(offloaded_or_over, 300, "the long stream to be offloaded or to end")
        assert seen[-1] == 1, (
            f"the stream ended (alive={t.is_alive()}) with num_requests_offloaded never 1 "
            f"(readings {seen}; offloaded_requests_total "
            f"{gauge(url, 'offloaded_requests_total')})")
        assert t.is_alive()  # the gauge read 1 while the request was still decoding
        t.join(600)
        assert not t.is_alive() and events[-1] == "[DONE]", events[-3:]
        assert _text(events) == want["long"]
        wait_for(lambda: gauge(url, "num_requests_offloaded") == 0, 20, "offloaded back to 0")
        assert gauge(url, "offloaded_requests_total") == 1
        # one per layer for each of the 239 tokens decoded on the decode rank (the first is
        # sampled on the prefill rank); m=2 micro-batches, the request in one of them
        trips = _num_layers(ckpt) * (LONG["max_tokens"] - 1)
        wait_for(lambda: gauge(url, "offload_round_trip_seconds_count") == trips, 20,
                 f"{trips} round trips")
        assert gauge(url, "offload_round_trip_seconds_sum") > 0
        assert asyncio.run(_streams(url)) == want["short"]  # together, each offloaded
        wait_for(lambda: gauge(url, "offloaded_requests_total") == 1 + len(PROMPTS), 20,
                 "every request counted")
        wait_for(lambda: gauge(url, "num_requests_offloaded") == 0, 20, "offloaded back to 0")
        srv.signal(signal.SIGTERM)
        assert srv.wait(60) == 0, srv.output()
        assert "still hold blocks" not in srv.output()  # every offloaded request released
    finally:
        srv.close()
