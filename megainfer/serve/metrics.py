"""Prometheus metrics under vLLM's names with a ``megainfer:`` prefix, one registry per server.

Two sources. The engine core measures itself wherever it runs (``engine.stats``:
each iteration's time, the generated tokens, single mode's queue times, PD's KV-transfer
times and, with ``pd.offload``, its offloaded requests and offload round trips, rank 0's T_a
with tracing on, and its queues) and sends that with its outputs; ``ServeMetrics.apply``
observes it (``CoreWatch`` keeps the queues and the offloaded requests, for the gauges, and the
iteration clock, for /health). The frontend observes each request's figures as its outputs
reach it (``RequestTimer``: TTFT, inter-token latency, end-to-end latency, finish reasons,
prefix-cache queries and hits). prometheus-client's metrics are thread-safe: ``apply`` runs on
the core's thread (or the socket reader's)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from megainfer.engine.stats import CoreStats, EngineLoad

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
        self.expert_layer = Histogram(P + "expert_layer_seconds", "T_e: one MoE layer's "
                                      "expert span of one micro-batch on an expert rank "
                                      "(trace.enabled=true on cpu only)", buckets=_SPAN, **lab)
        self.a2e_latency = Histogram(P + "a2e_latency_seconds", "T_c: rank 0's dispatch end "
                                     "to a waiting expert rank's arrival (trace.enabled=true on "
                                     "cpu only)", buckets=_SPAN, **lab)
        self.replans = Counter(P + "replans", "Re-plans: switches of every rank to another "
                               "attention:expert split (replan.enabled=true)", **lab)
        self.replan_switch = Histogram(P + "replan_switch_seconds", "Re-plans: one switch "
                                       "of every rank, by who ordered it (kind: forced, "
                                       "measured, planner)", buckets=_LATENCY,
                                       labelnames=["model_name", "kind"], registry=r)
        self.kv_transfer = Histogram(P + "kv_transfer_seconds", "PD: a request's KV from the "
                                     "end of its prefill to its decode start", buckets=_LATENCY,
                                     **lab)
        self.offloaded = Gauge(P + "num_requests_offloaded", "PD with pd.offload: requests "
                               "whose decode attention runs on a prefill rank now", **lab)
        self.offloaded_total = Counter(P + "offloaded_requests", "PD with pd.offload: requests "
                                       "whose decode attention was offloaded to a prefill rank",
                                       **lab)
        self.offload_homes = Counter(P + "offload_returned_home", "PD with pd.offload: "
                                     "offloaded requests whose KV moved home to their decode "
                                     "replica (the prefill rank needed the room)", **lab)
        self.offload_round_trip = Histogram(P + "offload_round_trip_seconds", "PD with "
                                            "pd.offload: one layer's offload exchange on a "
                                            "decode rank (q/k/v sent to the attention output "
                                            "back)", buckets=_SPAN, **lab)
        self.model_name = model_name

    def labels(self, metric, **kw):
        return metric.labels(model_name=self.model_name, **kw)

    def apply(self, stats: CoreStats, role_hist) -> None:
        """One ``CoreStats`` from the engine core into the histograms and counters."""
        for v in stats.iteration_s:
            role_hist.observe(v)
        for metric, values in ((self.queue, stats.queue_s),
                               (self.kv_transfer, stats.kv_transfer_s),
                               (self.attention_layer, stats.attention_layer_s),
                               (self.expert_layer, stats.expert_layer_s),
                               (self.a2e_latency, stats.a2e_latency_s),
                               (self.offload_round_trip, stats.offload_round_trip_s)):
            if values:
                h = self.labels(metric)
                for v in values:
                    h.observe(v)
        if stats.generated_tokens:
            self.labels(self.generation_tokens).inc(stats.generated_tokens)
        if stats.replans:
            self.labels(self.replans).inc(stats.replans)
        for kind, seconds in stats.replan_switch_s:
            self.labels(self.replan_switch, kind=kind).observe(seconds)
        if stats.offloaded_requests:
            self.labels(self.offloaded_total).inc(stats.offloaded_requests)
        if stats.offload_homes:
            self.labels(self.offload_homes).inc(stats.offload_homes)


RECENT_ITERATIONS = 16  # the slowest of these bounds how long an iteration may take (health)


class CoreWatch:
    """What the frontend knows of the engine core from its ``CoreStats``: its queues and its
    offloaded requests as last sent (the gauges), when an iteration of every rank last came (``last_iteration_at``,
    monotonic, this process's clock) and the slowest recent one, and whether it must keep
    iterating while idle (``idle_interval_s``: the runtime's ranks watch each other)."""

    def __init__(self, metrics: ServeMetrics, role: str):
        self.metrics, self.load = metrics, EngineLoad(0, 0, 0.0)
        self.offloaded = 0  # pd.offload: requests offloaded now (0 without)
        self.iteration = metrics.labels(metrics.iteration, role=role)
        self.recent_s: deque = deque(maxlen=RECENT_ITERATIONS)
        self.idle_interval_s: Optional[float] = None
        self.stall_allowance_s = 0.0
        self.last_iteration_at = time.monotonic()
        for g, f in ((metrics.running, lambda: self.load.running),
                     (metrics.waiting, lambda: self.load.queued),
                     (metrics.kv_usage, lambda: self.load.kv_usage),
                     (metrics.offloaded, lambda: self.offloaded)):
            metrics.labels(g).set_function(f)

    def apply(self, stats: CoreStats) -> None:
        """The core's callback (its thread, or the socket reader's)."""
        self.load, self.idle_interval_s = stats.load, stats.idle_interval_s
        self.stall_allowance_s = stats.stall_allowance_s
        if stats.offloaded is not None:
            self.offloaded = stats.offloaded
        if stats.iterations:
            self.last_iteration_at = time.monotonic()
            self.recent_s.extend(stats.iteration_s + stats.idle_tick_s)
        self.metrics.apply(stats, self.iteration)

    def slowest_recent_s(self) -> float:
        """The longest of the last ``RECENT_ITERATIONS`` iterations (0 before the first)."""
        return max(self.recent_s, default=0.0)


@dataclass(frozen=True)
class ServedRequest:
    """One finished request as the frontend measured it (``RequestTimer.served``)."""

    prompt_len: int
    output_len: int  # tokens of all its samples
    ttft_s: Optional[float]  # None: no token came
    tpot_s: Optional[float]  # (end-to-end - TTFT) / (tokens - 1); None with one token or none


class RequestTimer:
    """One request's latencies as its outputs reach the frontend."""

    def __init__(self, metrics: ServeMetrics):
        self.m, self.start = metrics, time.perf_counter()
        self.last: Optional[float] = None
        self.ttft_s: Optional[float] = None
        self.num_tokens = 0

    def tokens(self, total: int) -> None:
        """The request's outputs now hold ``total`` tokens (all samples)."""
        new = total - self.num_tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.ttft_s = now - self.start
            self.m.labels(self.m.ttft).observe(self.ttft_s)
            new -= 1
        elif new:
            gap = (now - self.last) / new
            h = self.m.labels(self.m.itl)
            for _ in range(new):
                h.observe(gap)
        self.last, self.num_tokens = now, total

    def served(self, out) -> ServedRequest:
        """What this finished request measured (the TPOT as the serving benchmark defines
        it)."""
        tpot = None
        if self.ttft_s is not None and self.num_tokens > 1:
            tpot = (self.last - self.start - self.ttft_s) / (self.num_tokens - 1)
        return ServedRequest(len(out.prompt_token_ids), self.num_tokens, self.ttft_s, tpot)

    def finished(self, out) -> None:
        m = self.m
        m.labels(m.e2e).observe(time.perf_counter() - self.start)
        for c in out.outputs:
            m.labels(m.success, finished_reason=c.finish_reason or "unknown").inc()
        n = len(out.prompt_token_ids)
        m.labels(m.prefix_queries).inc(n)
        m.labels(m.prefix_hits).inc(min(n, out.num_cached_tokens or 0))


def iteration_role(job) -> str:
    """The ``role`` label of ``iteration_time_seconds``: the deploy mode (``pd`` with prefill
    ranks)."""
    if job is None or job.deploy.mode == "single":
        return "single"
    return "pd" if job.deploy.prefill_replicas else job.deploy.mode
