"""What the engine core measures about its engine, shipped to its frontend with its outputs.

``CoreStatsRecorder`` belongs to an ``EngineCore`` (engine_core/core.py) and is told of each
iteration and idle tick the core runs: it times them, counts generated tokens and collects each
finished request's queue time (``RequestOutput.metrics.time_in_queue`` plus the engine's hold
before it, ``OnlineEngine.held_s``) and PD's KV-transfer time; the engine adds what only it
knows (``take_spans``: T_a, T_e, T_c with tracing on, cpu; ``replan_switches``; at ``take``,
``offload_report``: PD's offloaded decode attention). ``take`` empties that into one
``CoreStats`` with the engine's queues (``EngineLoad``) and offloaded requests as they are now.
Invariant: the frontend only applies what arrives, so the figures are the same whether the
core is a thread or a process away. docs/python_api.md, "Two ways to run a script";
docs/serve.md, "Metrics (`GET /metrics`)"."""
from __future__ import annotations

import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional


@dataclass(frozen=True)
class EngineLoad:
    running: int  # sequences in the running batch (the runtime: summed over its replicas)
    waiting: int  # sequences waiting (the runtime: on its replicas)
    kv_usage: float  # 1 = every KV block in use (the runtime: the replicas' mean)
    not_handed_out: int = 0  # the runtime: requests rank 0 has not handed out yet

    @property
    def queued(self) -> int:
        """Everything not running yet: waiting, and not handed out."""
        return self.waiting + self.not_handed_out


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
    # of those: (who ordered it: forced | measured | planner, its seconds), in order
    replan_switch_s: list[tuple[str, float]] = field(default_factory=list)
    offloaded_requests: int = 0  # pd.offload: requests offloaded since the last CoreStats
    offload_homes: int = 0  # pd.offload: offloaded requests whose KV moved home since the last
    # pd.offload: per-layer round trips of the offload exchange, as the decode ranks measured
    offload_round_trip_s: list[float] = field(default_factory=list)
    # pd.offload: requests whose decode attention runs on a prefill rank now (None: no offload)
    offloaded: Optional[int] = None
    # not None: the engine must be stepped at least this often (its ranks watch each other)
    idle_interval_s: Optional[float] = None
    # how much longer than its slowest iteration one iteration may take without a rank being
    # lost: a re-plan's switch runs inside one (each of its waits bounded by 2 comm.timeout_s)
    stall_allowance_s: float = 0.0

    @property
    def iterations(self) -> int:
        """Iterations of every rank, keep-alive ticks included (each one: every rank answered)."""
        return len(self.iteration_s) + len(self.idle_tick_s)


_NOT_MEASURED = ("load", "idle_interval_s", "stall_allowance_s", "offloaded")  # set at ``take``


class CoreStatsRecorder:
    """``engine``: an ``OnlineEngine``. ``take`` (the core's thread) -> the ``CoreStats`` since
    the last call, or None when nothing happened and the queues are as last sent."""

    def __init__(self, engine):
        self.engine = engine
        self.last_load: Optional[EngineLoad] = None
        self.fresh = self._empty()
        self.replans = 0  # re-plans counted so far
        self.offload_started = 0  # offloaded requests counted so far
        self.offload_homes = 0  # offloaded requests sent home counted so far
        self.last_offloaded: Optional[int] = None

    @staticmethod
    def _empty() -> dict:
        """CoreStats' measured fields, empty (all but the queues, the two settings and the
        requests offloaded now)."""
        return {f.name: f.default if f.default_factory is MISSING else f.default_factory()
                for f in fields(CoreStats) if f.name not in _NOT_MEASURED}

    def iteration(self, seconds: float, res) -> None:
        """One iteration of ``seconds`` whose ``StepOutputs`` were ``res``."""
        f, eng = self.fresh, self.engine
        f["iteration_s"].append(seconds)
        spans = eng.take_spans()
        if spans is not None:
            f["attention_layer_s"] += spans.attention_s
            f["expert_layer_s"] += spans.expert_s
            f["a2e_latency_s"] += spans.comm_s
        for out in res.finished:
            m = out.metrics
            if m is not None and m.time_in_queue is not None:
                f["queue_s"].append(m.time_in_queue + eng.held_s(out.request_id))
            if m is not None and m.kv_handoff_s is not None:
                f["kv_transfer_s"].append(m.kv_handoff_s)
        f["generated_tokens"] += sum(len(d.token_ids) for d in res.new_tokens)
        self._switches()

    def idle_tick(self, seconds: float) -> None:
        """One keep-alive iteration of ``seconds`` (a planner's switch may run in it)."""
        self.fresh["idle_tick_s"].append(seconds)
        self._switches()

    def _switches(self) -> None:
        """The re-plan switches since the last iteration or tick."""
        f, switches = self.fresh, self.engine.replan_switches()
        f["replans"] += len(switches) - self.replans
        f["replan_switch_s"] += switches[self.replans:]
        self.replans = len(switches)

    def take(self) -> Optional[CoreStats]:
        f, load = self.fresh, self.engine.load()
        off, offloaded = self.engine.offload_report(), None
        if off is not None:
            f["offload_round_trip_s"] += off.round_trip_s
            f["offloaded_requests"] += off.started - self.offload_started
            f["offload_homes"] += off.returned_home - self.offload_homes
            self.offload_started, offloaded = off.started, off.offloaded
            self.offload_homes = off.returned_home
        if load == self.last_load and offloaded == self.last_offloaded and not any(f.values()):
            return None
        self.fresh, self.last_load, self.last_offloaded = self._empty(), load, offloaded
        return CoreStats(load, idle_interval_s=self.engine.idle_interval_s,
                         stall_allowance_s=self.engine.stall_allowance_s, offloaded=offloaded,
                         **f)


def timed(fn) -> tuple[float, object]:
    """(seconds ``fn()`` took, what it returned)."""
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def core_hangs(busy_s: float, hang_s: float) -> Optional[str]:
    """The words for a core ``busy_s`` inside one round when that is past ``hang_s``
    (``OnlineEngine.hang_after_s``); None while it is not."""
    if busy_s <= hang_s:
        return None
    return f"its engine core has been inside one iteration for {busy_s:.1f}s, over {hang_s:g}s: " \
        "it hangs"
