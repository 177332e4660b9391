"""The serving benchmark's requests: the prompts (random token ids, or a jsonl file), their
arrival times (Poisson, or gamma with ``burstiness``), and one streamed request against any
OpenAI-compatible server (httpx), timed chunk by chunk as vLLM's ``bench serve`` does."""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import httpx


@dataclass
class BenchRequest:
    prompt: Union[str, list[int]]
    prompt_len: int
    output_len: int
    at: Optional[float] = None  # a trace's send time, seconds from its start (None: gaps)
    phase: str = ""  # a trace's phase


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first chunk with tokens
    itl: list[float] = field(default_factory=list)  # gaps between later chunks
    latency: float = 0.0
    error: str = ""
    sent_at: float = 0.0  # seconds from the benchmark's start to the request's send
    phase: str = ""


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, seed: int) -> list[BenchRequest]:
    """vLLM's random dataset: lengths uniform in [len*(1-r), len*(1+r)], token ids uniform in
    [0, vocab_size) (sent as token ids: exact prompt lengths on any tokenizer)."""
    rng = random.Random(seed)

    def draw(n):
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(lo, hi)
    out = []
    for _ in range(num):
        n = draw(input_len)
        out.append(BenchRequest([rng.randrange(vocab_size) for _ in range(n)], n,
                                draw(output_len)))
    return out


def jsonl_requests(path: str, num: int, output_len: int) -> list[BenchRequest]:
    """One request a line: ``{"prompt": text or token ids, "output_len"?: n}`` (also vLLM
    custom dataset's ``"output_tokens"``); the prompt length of text is its character count
    until the server's usage gives the token count."""
    out = []
    with open(path, encoding="utf-8") as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if not isinstance(d, dict) or "prompt" not in d:
                raise ValueError(f"{path}:{k}: needs a 'prompt'")
            p = d["prompt"]
            n = d.get("output_len", d.get("output_tokens", output_len))
            out.append(BenchRequest(p, len(p), int(n)))
            if len(out) == num:
                break
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def trace_requests(rows, vocab_size: int, seed: int) -> list[BenchRequest]:
    """A trace's rows (``serve_trace.TraceRow``) as requests of random token ids of their
    prompt lengths, sent at their times."""
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(vocab_size) for _ in range(r.input_len)], r.input_len,
                         r.output_len, r.at, r.phase) for r in rows]


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds before each request: 0 at an infinite rate, else gamma(shape=burstiness,
    scale=1/(rate*burstiness)) (burstiness 1: Poisson arrivals)."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed + 1)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]


async def send(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, chat: bool,
               ignore_eos: bool, headers: dict) -> RequestResult:
    """One streamed request; TTFT and the inter-chunk gaps from the first chunk with tokens; the
    output token count from the final usage chunk (include_usage)."""
    body = {"model": model, "max_tokens": req.output_len, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    res = RequestResult(prompt_len=req.prompt_len)
    t0 = time.perf_counter()
    last: Optional[float] = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                d = json.loads(data)
                if "error" in d:
                    res.error = str(d["error"].get("message"))
                    return res
                if d.get("usage"):
                    res.output_tokens = d["usage"]["completion_tokens"]
                    res.prompt_len = d["usage"]["prompt_tokens"]
                for c in (d.get("choices") or [])[:1]:  # a chunk = new tokens (its text may
                    # be empty while a character's bytes are incomplete)
                    if c.get("text") is not None or (c.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
        res.latency = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.success = last is not None
        if not res.success:
            res.error = "no tokens in the stream"
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res
