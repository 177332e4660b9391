"""Prometheus metrics under vLLM's names with a ``megainfer:`` prefix, one registry per server.

Gauges (running, waiting, KV use) are read from the engine when scraped. Per-request figures
(TTFT, inter-token latency, end-to-end latency, finish reasons, prompt tokens, prefix-cache
queries and hits) are observed by the frontend as outputs reach it (``RequestTimer``); the
iteration time, the generated tokens and each request's queue time by ``MeteredEngine``, on the
engine core's thread, around each iteration (prometheus-client's metrics are thread-safe)."""
from __future__ import annotations

import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # no *_created series (vLLM does the same)

P = "megainfer:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
        0.4, 0.5, 0.75, 1.0, 2.5)


class ServeMetrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        lab = dict(labelnames=["model_name"], registry=r)
        self.running = Gauge(P + "num_requests_running", "Sequences in the running batch", **lab)
        self.waiting = Gauge(P + "num_requests_waiting", "Sequences waiting to be scheduled",
                             **lab)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "KV-cache usage (1 = every block "
                              "in use)", **lab)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in "
                                      "the prefix cache", **lab)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens served from the "
                                   "prefix cache", **lab)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of admitted requests",
                                     **lab)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", **lab)
        self.success = Counter(P + "request_success", "Requests finished, by finish reason",
                               labelnames=["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY, **lab)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output tokens",
                             buckets=_ITL, **lab)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency (arrival to "
                             "last token)", buckets=_LATENCY, **lab)
        self.queue = Histogram(P + "request_queue_time_seconds", "Time waiting before the first "
                               "scheduled iteration", buckets=_LATENCY, **lab)
        self.iteration = Histogram(P + "iteration_time_seconds", "Engine iteration time "
                                   "(schedule, forward, sample)", buckets=_ITL,
                                   labelnames=["model_name", "role"], registry=r)
        self.model_name = model_name

    def labels(self, metric, **kw):
        return metric.labels(model_name=self.model_name, **kw)

    def watch_engine(self, engine) -> None:
        """Scrape-time gauges over an ``LLMEngine`` (lengths only: safe from another thread)."""
        sched, blocks = engine.scheduler, engine.blocks
        self.labels(self.running).set_function(lambda: len(sched.running))
        self.labels(self.waiting).set_function(lambda: len(sched.waiting))
        total = max(1, blocks.num_blocks)
        self.labels(self.kv_usage).set_function(lambda: 1.0 - blocks.num_free_blocks / total)


class RequestTimer:
    """One request's latencies as its outputs reach the frontend."""

    def __init__(self, metrics: ServeMetrics):
        self.m, self.start = metrics, time.perf_counter()
        self.last: Optional[float] = None
        self.num_tokens = 0

    def tokens(self, total: int) -> None:
        """The request's outputs now hold ``total`` tokens (all samples)."""
        new = total - self.num_tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.m.labels(self.m.ttft).observe(now - self.start)
            new -= 1
        elif new:
            gap = (now - self.last) / new
            h = self.m.labels(self.m.itl)
            for _ in range(new):
                h.observe(gap)
        self.last, self.num_tokens = now, total

    def finished(self, out) -> None:
        m = self.m
        m.labels(m.e2e).observe(time.perf_counter() - self.start)
        for c in out.outputs:
            m.labels(m.success, finished_reason=c.finish_reason or "unknown").inc()
        n = len(out.prompt_token_ids)
        m.labels(m.prefix_queries).inc(n)
        m.labels(m.prefix_hits).inc(min(n, out.num_cached_tokens or 0))


class MeteredEngine:
    """An ``OnlineEngine`` (engine/core.py) that times each iteration of the engine it wraps,
    counts its generated tokens and observes each request's queue time (arrival to first
    scheduled). Every other member is the wrapped engine's."""

    def __init__(self, engine, metrics: ServeMetrics, role: str = "single"):
        self.__dict__.update(_engine=engine, _m=metrics, _started=set(),
                             _iter=metrics.labels(metrics.iteration, role=role))

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __setattr__(self, name, value):  # detokenize, set by EngineCore
        setattr(self._engine, name, value)

    def step_outputs(self):
        eng, m = self._engine, self._m
        waiting = list(eng.scheduler.waiting)  # the core's thread: nothing mutates it now
        t0 = time.perf_counter()
        res = eng.step_outputs()
        self._iter.observe(time.perf_counter() - t0)
        left = {id(r) for r in eng.scheduler.waiting}
        for r in waiting:
            if id(r) not in left and r.request_id not in self._started:
                self._started.add(r.request_id)
                m.labels(m.queue).observe(t0 - r.arrival_time)
        for out in res.finished:
            self._started.discard(str(out.request_id))
        m.labels(m.generation_tokens).inc(sum(len(d.token_ids) for d in res.new_tokens))
        return res

    def abort_request(self, request_id):
        self._started.discard(str(request_id))
        return self._engine.abort_request(request_id)
