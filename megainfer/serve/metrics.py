"""Prometheus metrics under vLLM's names with a ``megainfer:`` prefix, one registry per server.

Gauges (running, waiting, KV use) are read from the engine when scraped (``engine_load``:
single mode's scheduler and block pool; the runtime's ``RuntimeEngine.load()``, every replica's
queues at the last iteration). Per-request figures (TTFT, inter-token latency, end-to-end
latency, finish reasons, prompt tokens, prefix-cache queries and hits) are observed by the
frontend as outputs reach it (``RequestTimer``); the iteration time, the generated tokens, PD's
KV-transfer time, rank 0's T_a (tracing on) and (single mode only) each request's queue time by
``MeteredEngine``, on the engine core's thread, around each iteration (prometheus-client's
metrics are thread-safe)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from megainfer.perfmodel.trace import is_moe_attention

disable_created_metrics()  # no *_created series (vLLM does the same)

P = "megainfer:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0)
_SPAN = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25)
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
                                   "(schedule, forward, sample; the runtime: one iteration of "
                                   "every rank, as rank 0 sees it)", buckets=_ITL,
                                   labelnames=["model_name", "role"], registry=r)
        self.attention_layer = Histogram(P + "attention_layer_seconds", "T_a: one MoE "
                                         "layer's attention span of one micro-batch on rank 0 "
                                         "(trace.enabled=true on cpu only)", buckets=_SPAN,
                                         **lab)
        self.kv_transfer = Histogram(P + "kv_transfer_seconds", "PD: a request's KV from the "
                                     "end of its prefill to its decode start", buckets=_LATENCY,
                                     **lab)
        self.model_name = model_name

    def labels(self, metric, **kw):
        return metric.labels(model_name=self.model_name, **kw)

    def watch_engine(self, engine) -> None:
        """Scrape-time gauges over either engine (``engine_load``)."""
        self.labels(self.running).set_function(lambda: engine_load(engine).running)
        self.labels(self.waiting).set_function(lambda: engine_load(engine).waiting)
        self.labels(self.kv_usage).set_function(lambda: engine_load(engine).kv_usage)


@dataclass(frozen=True)
class EngineLoad:
    running: int  # sequences in the running batch (the runtime: summed over its replicas)
    waiting: int  # sequences waiting (the runtime: and the requests rank 0 has not handed out)
    kv_usage: float  # 1 = every KV block in use (the runtime: the replicas' mean)


def engine_load(engine) -> EngineLoad:
    """The online engine's queues, safe from another thread (lengths and the runtime's
    last-iteration reports only): a ``RuntimeEngine`` (it has ``load()``) or an ``LLMEngine``."""
    if hasattr(engine, "load"):
        ld = engine.load()
        return EngineLoad(ld.running, ld.waiting + ld.not_handed_out, ld.kv_usage)
    sched, blocks = engine.scheduler, engine.blocks
    return EngineLoad(len(sched.running), len(sched.waiting),
                      1.0 - blocks.num_free_blocks / max(1, blocks.num_blocks))


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


class QueueTimes:
    """Single mode: each request's queue time (arrival to the first iteration that schedules
    it), read from the ``LLMEngine``'s waiting queue around each iteration. (The runtime's rank
    0 cannot see when a replica first schedules a request: no queue time there.)"""

    def __init__(self, engine, metrics: ServeMetrics):
        self.engine, self.m, self.started = engine, metrics, set()
        self.waiting: list = []

    def before(self) -> None:
        self.waiting = list(self.engine.scheduler.waiting)  # the core's thread: nothing mutates it

    def after(self, t0: float, finished) -> None:
        left = {id(r) for r in self.engine.scheduler.waiting}
        for r in self.waiting:
            if id(r) not in left and r.request_id not in self.started:
                self.started.add(r.request_id)
                self.m.labels(self.m.queue).observe(t0 - r.arrival_time)
        for out in finished:
            self.started.discard(str(out.request_id))

    def forget(self, request_id) -> None:
        self.started.discard(str(request_id))


class RankZeroSpans:
    """T_a as rank 0 records it: its tracer's MoE attention spans (``is_moe_attention``, what
    ``runtime/trace_metrics`` takes T_a from) since the last iteration, into
    ``attention_layer_seconds``. Only with ``trace.enabled=true`` and on cpu (a cuda span's
    duration is known only when the trace is resolved, which synchronises the device); T_e and
    T_c live on the other ranks' tracers and are not observed here."""

    def __init__(self, engine, metrics: ServeMetrics):
        tracer = getattr(getattr(engine, "rank", None), "tracer", None)
        ok = tracer is not None and tracer.enabled and not tracer.cuda
        self.tracer = tracer if ok else None
        self.hist, self.seen = metrics.labels(metrics.attention_layer), 0

    def observe(self) -> None:
        if self.tracer is None:
            return
        events = self.tracer.events
        for e in events[self.seen:]:
            if is_moe_attention(e):
                self.hist.observe(e["dur"] / 1e6)
        self.seen = len(events)


RECENT_ITERATIONS = 16  # the slowest of these bounds how long an iteration may take (health)


def iteration_role(job) -> str:
    """The ``role`` label of ``iteration_time_seconds``: the deploy mode (``pd`` with prefill
    ranks)."""
    if job is None or job.deploy.mode == "single":
        return "single"
    return "pd" if job.deploy.prefill_replicas else job.deploy.mode


class MeteredEngine:
    """An ``OnlineEngine`` (engine/core.py) that times each iteration of the engine it wraps,
    counts its generated tokens, observes PD's KV-transfer time of each finished request and,
    in single mode, each request's queue time. Every other member is the wrapped engine's."""

    def __init__(self, engine, metrics: ServeMetrics, role: str = "single"):
        queue = None if hasattr(engine, "load") else QueueTimes(engine, metrics)
        self.__dict__.update(_engine=engine, _m=metrics, _queue=queue,
                             _spans=RankZeroSpans(engine, metrics),
                             _iter=metrics.labels(metrics.iteration, role=role),
                             _kv=metrics.labels(metrics.kv_transfer),
                             recent_s=deque(maxlen=RECENT_ITERATIONS), error=None)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __setattr__(self, name, value):  # detokenize, set by EngineCore
        setattr(self._engine, name, value)

    def slowest_recent_s(self) -> float:
        """The longest of the last ``RECENT_ITERATIONS`` iterations (0 before the first)."""
        return max(self.recent_s, default=0.0)

    def step_outputs(self):
        eng, m, q = self._engine, self._m, self._queue
        if q is not None:
            q.before()
        t0 = time.perf_counter()
        try:
            res = eng.step_outputs()
        except BaseException as e:
            self.__dict__["error"] = e  # the core dies of it (the server's watchdog reports it)
            raise
        dt = time.perf_counter() - t0
        self._iter.observe(dt)
        self.recent_s.append(dt)
        if q is not None:
            q.after(t0, res.finished)
        self._spans.observe()
        for out in res.finished:
            kv = getattr(out.metrics, "kv_handoff_s", None)
            if kv is not None:
                self._kv.observe(kv)
        m.labels(m.generation_tokens).inc(sum(len(d.token_ids) for d in res.new_tokens))
        return res

    def idle_tick(self):  # timed like any iteration (the runtime's ranks all take part)
        t0 = time.perf_counter()
        try:
            self._engine.idle_tick()
        except BaseException as e:
            self.__dict__["error"] = e
            raise
        self.recent_s.append(time.perf_counter() - t0)

    def abort_request(self, request_id):
        if self._queue is not None:
            self._queue.forget(request_id)
        return self._engine.abort_request(request_id)
