"""What the engine core measures about itself, shipped to its frontend with its outputs.

``StatsRecorder`` wraps the core's ``OnlineEngine`` (single mode's ``LLMEngine`` or rank 0's
``RuntimeEngine``) on the core's own thread, wherever that runs (this process, rank 0 under
``mpiexec``, rank 0 of a spawned job): it times each iteration and idle tick, counts the
generated tokens, and collects each finished request's queue time and PD's KV-transfer time
(from its ``RequestOutput.metrics``, as vLLM observes them at the end) and rank 0's T_a spans
and the expert ranks' T_e and T_c (tracing on, cpu: ``runtime/span_report.py``). ``take``
empties that into one ``CoreStats`` with the engine's queues (``EngineLoad``) as they are now;
``EngineCoreThread`` sends it with each ``CoreOutputs``. The
frontend (the server's metrics, docs/serve.md) only applies what arrives, so the figures are
the same whether the core is a thread beside it or a process away.
"""
from __future__ import annotations

import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional

from megainfer.runtime import timeouts


@dataclass(frozen=True)
class EngineLoad:
    running: int  # sequences in the running batch (the runtime: summed over its replicas)
    waiting: int  # sequences waiting (the runtime: and the requests rank 0 has not handed out)
    kv_usage: float  # 1 = every KV block in use (the runtime: the replicas' mean)


def engine_load(engine) -> EngineLoad:
    """The online engine's queues: a ``RuntimeEngine`` (it has ``load()``: every replica's
    report at the last iteration) or an ``LLMEngine`` (its scheduler and block pool)."""
    if hasattr(engine, "load"):
        ld = engine.load()
        return EngineLoad(ld.running, ld.waiting + ld.not_handed_out, ld.kv_usage)
    sched, blocks = engine.scheduler, engine.blocks
    return EngineLoad(len(sched.running), sched.num_waiting,
                      1.0 - blocks.num_free_blocks / max(1, blocks.num_blocks))


@dataclass
class CoreStats:
    """The core's measurements since the last ``CoreStats``, and its queues now."""

    load: EngineLoad
    iteration_s: list[float] = field(default_factory=list)  # each iteration's wall time
    idle_tick_s: list[float] = field(default_factory=list)  # each empty keep-alive iteration
    generated_tokens: int = 0
    queue_s: list[float] = field(default_factory=list)  # arrival -> first scheduled step
    kv_transfer_s: list[float] = field(default_factory=list)  # PD: prefill end -> decode start
    attention_layer_s: list[float] = field(default_factory=list)  # T_a spans (rank 0's tracer)
    expert_layer_s: list[float] = field(default_factory=list)  # T_e spans (the expert ranks')
    a2e_latency_s: list[float] = field(default_factory=list)  # T_c: dispatch end -> arrival
    replans: int = 0  # re-plans (switches of every rank) since the last CoreStats
    # not None: the engine must be stepped at least this often (its ranks watch each other)
    idle_interval_s: Optional[float] = None
    # how much longer than its slowest iteration one iteration may take without a rank being
    # lost: a re-plan's switch runs inside one (each of its waits bounded by 2 comm.timeout_s)
    stall_allowance_s: float = 0.0

    @property
    def iterations(self) -> int:
        """Iterations of every rank, keep-alive ticks included (each one: every rank answered)."""
        return len(self.iteration_s) + len(self.idle_tick_s)


_NOT_MEASURED = ("load", "idle_interval_s", "stall_allowance_s")  # set at ``take``


def stall_allowance_s(engine) -> float:
    """A runtime that re-plans online (a plug between its iterations): two ``comm.timeout_s``,
    the bound of each wait of a switch; else 0."""
    if getattr(engine, "plug", None) is None:
        return 0.0
    return timeouts.switch_wait_s(float(engine.rank.job.comm.timeout_s))


def hang_after_s(engine, job) -> float:
    """How long an engine core may stay inside one round (its inputs, one iteration, the
    delivery) before it is declared hung: ``comm.timeout_s`` in single mode; for the runtime's
    rank 0 ``timeouts.core_hang_s`` of it, plus a re-plan's switch allowance where it re-plans
    online."""
    t = float(job.comm.timeout_s)
    hang = timeouts.core_hang_s(t) if getattr(engine, "rank", None) is not None else t
    return hang + stall_allowance_s(engine)


def core_hangs(busy_s: float, hang_s: float):
    """The words for a core ``busy_s`` inside one round when that is past ``hang_s``
    (``hang_after_s``); None while it is not."""
    if busy_s <= hang_s:
        return None
    return f"its engine core has been inside one iteration for {busy_s:.1f}s, over {hang_s:g}s: " \
        "it hangs"


def pipeline_spans(engine):
    """Rank 0 of a runtime traced on cpu: its ``span_report.PipelineSpans`` (T_a, T_e, T_c);
    else None (a cuda span's duration is known only when the trace is resolved, which
    synchronises the device)."""
    rank = getattr(engine, "rank", None)
    tracer = getattr(rank, "tracer", None)
    if tracer is None or not tracer.enabled or tracer.cuda:
        return None
    from megainfer.runtime.span_report import PipelineSpans
    return PipelineSpans(rank)


class StatsRecorder:
    """An ``OnlineEngine`` (engine/core.py) that records what its wrapped engine's iterations
    measure; every other member is the wrapped engine's. ``take`` (the core's thread) -> the
    ``CoreStats`` since the last call, or None when nothing happened and the queues are as
    last sent."""

    def __init__(self, engine):
        self.__dict__.update(_engine=engine, _spans=pipeline_spans(engine), _last_load=None,
                             _fresh=self._empty(), _replans=0,
                             _allowance=stall_allowance_s(engine))

    @staticmethod
    def _empty() -> dict:
        """CoreStats' measured fields, empty (all but the queues and the two settings)."""
        return {f.name: f.default if f.default_factory is MISSING else f.default_factory()
                for f in fields(CoreStats) if f.name not in _NOT_MEASURED}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __setattr__(self, name, value):  # detokenize, set by EngineCore
        setattr(self._engine, name, value)

    def step_outputs(self):
        f = self._fresh
        t0 = time.perf_counter()
        res = self._engine.step_outputs()
        f["iteration_s"].append(time.perf_counter() - t0)
        if self._spans is not None:
            got = self._spans.take()
            f["attention_layer_s"] += got.attention_s
            f["expert_layer_s"] += got.expert_s
            f["a2e_latency_s"] += got.comm_s
        for out in res.finished:
            m = out.metrics
            if m is not None and m.time_in_queue is not None:
                f["queue_s"].append(m.time_in_queue + self._held_s(out.request_id))
            if m is not None and m.kv_handoff_s is not None:
                f["kv_transfer_s"].append(m.kv_handoff_s)
        f["generated_tokens"] += sum(len(d.token_ids) for d in res.new_tokens)
        replans = len(getattr(self._engine, "replans", ()))
        f["replans"] += replans - self._replans
        self.__dict__["_replans"] = replans
        return res

    def _held_s(self, request_id) -> float:
        """The runtime: how long rank 0 held the request before handing it out (its queue
        time above is its replica's); single mode: 0."""
        held = getattr(self._engine, "held_s", None)
        return 0.0 if held is None else held(request_id)

    def idle_tick(self):  # timed like any iteration (the runtime's ranks all take part)
        t0 = time.perf_counter()
        self._engine.idle_tick()
        self._fresh["idle_tick_s"].append(time.perf_counter() - t0)

    def take(self) -> Optional[CoreStats]:
        f, load = self._fresh, engine_load(self._engine)
        if load == self._last_load and not any(f.values()):
            return None
        self.__dict__.update(_fresh=self._empty(), _last_load=load)
        return CoreStats(load, idle_interval_s=getattr(self._engine, "idle_interval_s", None),
                         stall_allowance_s=self._allowance, **f)
