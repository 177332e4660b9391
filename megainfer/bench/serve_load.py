"""``megainfer-bench-serve``: vLLM's ``bench serve`` against any OpenAI-compatible server.

    megainfer-bench-serve --base-url http://127.0.0.1:8000 --model M --dataset-name random \
        --random-input-len 128 --random-output-len 64 --num-prompts 200 --request-rate 8 \
        --max-concurrency 32 --goodput ttft:500 tpot:50 --save-result

Same flags, metrics and printed table as vLLM's (request and output throughput, goodput, TTFT /
TPOT / ITL / E2EL mean, median and the chosen percentiles), a tqdm progress bar, and
``--save-result`` JSON with vLLM's key names. ``--trace FILE`` or ``--trace-shape`` replays a
trace open-loop (``serve_trace``), with results per phase and ``--timeline`` a picture.
docs/serve.md, "Benchmark" and "Trace replay".
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time
from typing import Optional

import httpx
import numpy as np

from . import serve_trace
from .serve_requests import (RequestResult, arrival_gaps, jsonl_requests, random_requests, send,
                             trace_requests)

METRICS = ("ttft", "tpot", "itl", "e2el")
NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
         "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser("megainfer-bench-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default /v1/completions "
                   "(openai-chat: /v1/chat/completions)")
    p.add_argument("--model", required=True)
    p.add_argument("--dataset-name", default="random", choices=["random", "custom", "jsonl"])
    p.add_argument("--dataset-path", default=None, help="jsonl: {'prompt', 'output_len'?}")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-vocab-size", type=int, default=256,
                   help="random prompt token ids are drawn from [0, this)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="default 1000 (a trace: all of its requests)")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--trace", default=None, metavar="FILE", help="replay a trace: Azure or "
                   "BurstGPT CSV, or jsonl {timestamp, input_len, output_len, phase?}")
    p.add_argument("--trace-shape", default=None, metavar="PHASE:S,...", help="a synthetic "
                   f"trace of phases {sorted(serve_trace.PHASES)}, relative to --request-rate "
                   "and --random-input-len / --random-output-len")
    p.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="send times x this (0.5: twice as fast)")
    p.add_argument("--trace-max-len", type=int, default=None,
                   help="synthetic trace: prompt + output within this (the server's "
                   "max_model_len)")
    p.add_argument("--trace-save", default=None, metavar="FILE", help="write the synthetic "
                   "trace (jsonl) here")
    p.add_argument("--timeline", default=None, metavar="PNG",
                   help="a trace's timeline picture (needs matplotlib)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    a = p.parse_args(argv)
    a.slos = parse_goodput(a.goodput) if a.goodput else {}
    a.metrics = [m.strip() for m in a.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in a.metrics if m not in METRICS]
    if bad:
        p.error(f"--percentile-metrics: {bad} not in {list(METRICS)}")
    a.percentiles = [float(x) for x in a.metric_percentiles.split(",")]
    if a.dataset_name != "random" and not a.dataset_path:
        p.error("--dataset-path is needed for a jsonl dataset")
    if a.trace and a.trace_shape:
        p.error("--trace and --trace-shape: give one")
    if a.trace_shape and a.request_rate == float("inf"):
        p.error("--trace-shape needs a finite --request-rate (the phases' base rate)")
    if not a.trace_time_scale > 0:
        p.error(f"--trace-time-scale={a.trace_time_scale}: must be > 0")
    return a


def parse_goodput(items: list[str]) -> dict[str, float]:
    out = {}
    for it in items:
        k, _, v = it.partition(":")
        if k not in ("ttft", "tpot", "e2el") or not v:
            raise SystemExit(f"--goodput {it!r}: must be ttft:MS, tpot:MS or e2el:MS")
        out[k] = float(v)
    return out


async def run(a, requests, switches: Optional[list] = None
              ) -> tuple[list[RequestResult], float]:
    """Send ``requests`` (at a trace's times, else by the rate's gaps); ``switches``: a list the
    re-plan switch times are appended to (``serve_trace.replan_times``; None: not watched)."""
    base = (a.base_url or f"http://{a.host}:{a.port}").rstrip("/")
    url = base + (a.endpoint or ("/v1/chat/completions" if a.backend == "openai-chat"
                                 else "/v1/completions"))
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    gaps = arrival_gaps(len(requests), a.request_rate, a.burstiness, a.seed)
    sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
    bar = None
    if not a.disable_tqdm:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(requests), desc="requests", unit="req")
    limits = httpx.Limits(max_connections=a.max_concurrency or len(requests),
                          max_keepalive_connections=a.max_concurrency or len(requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0), limits=limits) as client:
        async def one(req):
            sent = time.perf_counter() - t0
            if sem is None:
                r = await send(client, url, a.model, req, a.backend == "openai-chat",
                               a.ignore_eos, headers)
            else:
                async with sem:
                    r = await send(client, url, a.model, req, a.backend == "openai-chat",
                                   a.ignore_eos, headers)
            if bar is not None:
                bar.update(1)
            r.sent_at, r.phase = sent, req.phase
            return r
        t0 = time.perf_counter()
        done = asyncio.Event()
        watch = None if switches is None else asyncio.create_task(
            serve_trace.replan_times(client, base, t0, done, switches))
        tasks = []
        for req, gap in zip(requests, gaps):
            if req.at is not None:  # a trace: open loop, at its own times
                gap = t0 + req.at * a.trace_time_scale - time.perf_counter()
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        done.set()
        if watch is not None:
            await watch
    if bar is not None:
        bar.close()
    return list(results), duration


def summarize(a, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [g for r in ok for g in r.itl]
    e2el = [r.latency for r in ok]
    good = 0
    for r in ok:
        t = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        vals = {"ttft": r.ttft, "tpot": t, "e2el": r.latency}
        good += all(vals[k] * 1000 <= v for k, v in a.slos.items())
    inp, outp = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    d = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": a.backend,
         "model_id": a.model, "num_prompts": len(results), "request_rate": a.request_rate
         if a.request_rate != float("inf") else "inf", "burstiness": a.burstiness,
         "max_concurrency": a.max_concurrency, "duration": duration, "completed": len(ok),
         "failed": len(results) - len(ok), "total_input_tokens": inp,
         "total_output_tokens": outp, "request_throughput": len(ok) / duration,
         "request_goodput": good / duration if a.slos else None,
         "output_throughput": outp / duration, "total_token_throughput": (inp + outp) / duration,
         "input_lens": [r.prompt_len for r in results],
         "output_lens": [r.output_tokens for r in results], "ttfts": ttft, "itls":
         [r.itl for r in results], "errors": [r.error for r in results]}
    for m, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        v = np.asarray(vals or [0.0]) * 1000
        d[f"mean_{m}_ms"], d[f"median_{m}_ms"], d[f"std_{m}_ms"] = (
            float(v.mean()), float(np.median(v)), float(v.std()))
        for p in a.percentiles:
            d[f"p{p:g}_{m}_ms"] = float(np.percentile(v, p))
    if a.slos:
        d["goodput_slos_ms"] = a.slos
    return d


SUMMARY_ONLY = ("date", "backend", "model_id", "request_rate", "burstiness", "max_concurrency")


def summarize_phases(a, results: list[RequestResult]) -> dict:
    """A trace's results per phase (in order of first send): ``summarize`` over its requests,
    its duration from its first send to its last answer."""
    out = {}
    for name in dict.fromkeys(r.phase for r in results):
        rs = [r for r in results if r.phase == name]
        span = max(r.sent_at + r.latency for r in rs) - min(r.sent_at for r in rs)
        d = summarize(a, rs, max(span, 1e-9))
        out[name] = {k: v for k, v in d.items()
                     if k not in SUMMARY_ONLY and not isinstance(v, (list, dict))}
    return out


def table(a, d: dict) -> str:
    w = 40
    rows = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
            f"{'Successful requests:':<{w}}{d['completed']:<10}",
            f"{'Failed requests:':<{w}}{d['failed']:<10}"]
    if a.max_concurrency:
        rows.append(f"{'Maximum request concurrency:':<{w}}{a.max_concurrency:<10}")
    rows += [f"{'Benchmark duration (s):':<{w}}{d['duration']:<10.2f}",
             f"{'Total input tokens:':<{w}}{d['total_input_tokens']:<10}",
             f"{'Total generated tokens:':<{w}}{d['total_output_tokens']:<10}",
             f"{'Request throughput (req/s):':<{w}}{d['request_throughput']:<10.2f}"]
    if d["request_goodput"] is not None:
        rows.append(f"{'Request goodput (req/s):':<{w}}{d['request_goodput']:<10.2f}")
    rows += [f"{'Output token throughput (tok/s):':<{w}}{d['output_throughput']:<10.2f}",
             f"{'Total Token throughput (tok/s):':<{w}}{d['total_token_throughput']:<10.2f}"]
    for m in a.metrics:
        rows.append("{s:{c}^{n}}".format(s=NAMES[m], n=50, c="-"))
        M = m.upper()
        rows.append(f"{f'Mean {M} (ms):':<{w}}{d[f'mean_{m}_ms']:<10.2f}")
        rows.append(f"{f'Median {M} (ms):':<{w}}{d[f'median_{m}_ms']:<10.2f}")
        for p in a.percentiles:
            rows.append(f"{f'P{p:g} {M} (ms):':<{w}}{d[f'p{p:g}_{m}_ms']:<10.2f}")
    rows.append("=" * 50)
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    try:
        rows = serve_trace.trace_rows(a)
    except (ValueError, OSError) as e:
        raise SystemExit(f"megainfer-bench-serve: {e}") from None
    if rows is not None:
        rows = rows if a.num_prompts is None else rows[:a.num_prompts]
        reqs = trace_requests(rows, a.random_vocab_size, a.seed)
    elif a.dataset_name == "random":
        reqs = random_requests(a.num_prompts or 1000, a.random_input_len, a.random_output_len,
                               a.random_range_ratio, a.random_vocab_size, a.seed)
    else:
        reqs = jsonl_requests(a.dataset_path, a.num_prompts or 1000, a.random_output_len)
    print(f"Traffic request rate: {a.request_rate}, burstiness: {a.burstiness}, "
          f"max concurrency: {a.max_concurrency}", flush=True)
    switches = [] if rows is not None else None
    results, duration = asyncio.run(run(a, reqs, switches))
    d = summarize(a, results, duration)
    print(table(a, d), flush=True)
    if rows is not None:
        d["phases"], d["replan_switches_s"] = summarize_phases(a, results), switches
        d["sent_at"], d["phase_of"] = [r.sent_at for r in results], [r.phase for r in results]
        d["trace"] = a.trace or a.trace_shape
        print(serve_trace.phase_table(d["phases"], a.percentiles[-1]), flush=True)
        if a.timeline:
            serve_trace.timeline(a.timeline, rows, results, switches, a.slos)
            print(f"timeline: {a.timeline}", flush=True)
    errs = [e for e in d["errors"] if e]
    if errs:
        print(f"{len(errs)} requests failed, first: {errs[0]}", file=sys.stderr)
    if a.save_result:
        for kv in a.metadata:
            k, _, v = kv.partition("=")
            d[k] = v
        name = a.result_filename or (f"{a.backend}-{a.request_rate}qps-"
                                     f"{a.model.replace('/', '_')}-{d['date']}.json")
        path = os.path.join(a.result_dir, name)
        os.makedirs(a.result_dir or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(d, f, indent=1)
        print(f"result: {path}", flush=True)
    return 0 if d["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
