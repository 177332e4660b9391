"""The live planner inside megainfer-serve (``replan.policy=planner``): every
``replan.planner_interval_s`` the interval's served traffic (``served_window``) goes to
``LivePlanner.decide`` (in a niced child process, ``planner_child``: it runs the simulations),
over every A:E split of the same ranks a running job can switch to
(``live_candidates.ReachableAssignments``: a better PD split is named in the decision, not
ordered); a ``switch`` is ordered through the engine core's
re-plan path (``ServedEngine.order_replan``, as a forced switch is carried out). Every decision is
logged with its reason and numbers, counted (``megainfer:planner_decisions_total{outcome}``) and
the latest ``KEEP`` kept for ``GET /planner``. docs/replan.md, "The live planner"."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional

from prometheus_client import Counter

from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.model.weight_format import with_weight_format
from megainfer.perfmodel.plan.auto_plan import hardware_for
from megainfer.perfmodel.plan.goodput import Slo
from megainfer.perfmodel.plan.live_candidates import (ReachableAssignments, SimulatedAssignments,
                                                      decode_label, Switchable)
from megainfer.perfmodel.plan.live_planner import LivePlanner
from megainfer.perfmodel.plan.world_serving import ServingPins

from .metrics import P, ServedRequest, ServeMetrics
from .planner_child import KEEP, PlannerChild, PlannerHere
from .served_window import ServedWindowRecorder

log = logging.getLogger("megainfer.serve")
MAX_SIMS = 12  # simulations a decision runs at most (the current split always among them)
OUTCOMES = ("stay", "hold", "switch", "error")


@dataclass(frozen=True)
class PlannerEntry:
    """One decision as ``GET /planner`` shows it."""

    at_s: float  # the window's end, seconds since the planner started
    action: str  # stay | hold | switch | error
    current: str
    target: str
    reason: str
    window: dict  # the ServedWindow decided on
    load: Optional[dict]  # the forecast the candidates were judged at
    corrections: Optional[tuple]  # (ttft, tpot)
    predicted: dict  # assignment -> predicted goodput, req/s (the reachable ones)
    unreachable: Optional[dict] = None  # a better split the runtime cannot switch to
    decide_s: float = 0.0  # how long the decision took (its simulations)


def _unreachable_note(p) -> str:
    return (f"; {p.assignment} is predicted better ({p.goodput_req_s:.3g} req/s) but not "
            "reachable online (re-planning switches A:E splits of the same ranks, no prefill "
            "ranks)")


class ServedPlanner:
    """A ``served_engine.TrafficPlanner``: ``planner`` decides, ``evaluate`` (its evaluator, a
    ``ReachableAssignments``) says which better split it could not reach; ``decider`` runs the
    decisions (``planner_child.PlannerChild`` in a server, on this process's worker thread by
    default). ``planner`` here also holds the settings and the current assignment ``GET
    /planner`` shows."""

    def __init__(self, planner: LivePlanner, evaluate, interval_s: float, percentile: float,
                 metrics: ServeMetrics, decider=None):
        self.planner, self.evaluate, self.interval_s = planner, evaluate, interval_s
        self.decider = decider or PlannerHere(planner, evaluate)
        self.window = ServedWindowRecorder(percentile)
        self.entries: deque[PlannerEntry] = deque(maxlen=KEEP)
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.decisions = Counter(P + "planner_decisions", "Live planner decisions "
                                 "(replan.policy=planner), by outcome: stay, hold, switch, "
                                 "error", labelnames=["model_name", "outcome"],
                                 registry=metrics.registry)
        self.metrics = metrics

    @classmethod
    def for_job(cls, job, hardware: Optional[str], metrics: ServeMetrics) -> "ServedPlanner":
        """The planner of a resolved job: its model, ranks, scheduler, ``replan.*`` and
        ``slo.*``; ``hardware``: ``deploy.hardware`` (None: as ``deploy=auto`` finds it)."""
        d, r, slo, ld = job.deploy, job.replan, job.slo, job.load
        hw, _ = hardware_for(hardware, job.device.device)
        shape = with_weight_format(ModelShape.from_model_config(job.model, "served"),
                                   ld.quantization, ld.quantization_group_size, ld.path)
        hold = d.micro_batches if r.micro_batches == "hold" else None
        world = d.world_size
        sims = SimulatedAssignments(
            shape, hw, world, Slo(slo.ttft_ms / 1e3, slo.tpot_ms / 1e3, slo.percentile),
            job.scheduler.max_num_seqs, job.scheduler.max_num_batched_tokens,
            ServingPins(attention_tp=1, micro_batches=hold),
            "float32" if "float32" in hw.matmul_flops else sorted(hw.matmul_flops)[0],
            num_requests=slo.num_requests, max_sims=MAX_SIMS)
        evaluate = ReachableAssignments(sims, Switchable(world, job.model.num_experts, hold))
        current = decode_label(d.attention_replicas, d.expert_ranks, d.micro_batches)
        planner = LivePlanner(evaluate, current, r.horizon_s, r.switch_s, r.min_gain,
                              r.dwell_s, r.confirm)
        log.info("[planner] live planner on: every %gs from %s over %d ranks (hardware %s), "
                 "SLOs TTFT %g ms / TPOT %g ms at p%g", r.planner_interval_s, current, world,
                 hw.name, slo.ttft_ms, slo.tpot_ms, slo.percentile)
        return cls(planner, evaluate, r.planner_interval_s, slo.percentile, metrics,
                   PlannerChild(planner, evaluate))

    # ------------------------------------------------------------------ TrafficPlanner
    def arrived(self, prompt_len: int) -> None:
        self.window.arrived(prompt_len)

    def finished(self, req: ServedRequest) -> None:
        self.window.finished(req)

    async def run(self, client) -> None:
        """Every ``interval_s`` until cancelled: one decision, a switch ordered."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.step(client)

    async def step(self, client) -> PlannerEntry:
        """Decide on the window since the last step; order the switch it decides."""
        w = self.window.take(client.watch.load.queued)
        t0 = time.perf_counter()
        try:
            d, better, self.planner.current = await asyncio.to_thread(self.decider.decide, w)
        except Exception as e:  # noqa: BLE001 - logged and shown; the server serves on
            log.exception("[planner] decision failed")
            cur = self.planner.current
            return self._keep(PlannerEntry(w.end_s, "error", cur, cur, f"{type(e).__name__}: "
                                           f"{e}", asdict(w), None, None, {}))
        reason = d.reason + (_unreachable_note(better) if better is not None else "")
        entry = self._keep(PlannerEntry(
            w.end_s, d.action, d.current, d.target, reason, asdict(w), asdict(d.load),
            d.corrections, d.predicted, None if better is None else
            dict(assignment=better.assignment, goodput_req_s=better.goodput_req_s,
                 deploy=better.deploy), time.perf_counter() - t0))
        if d.action == "switch":
            client.order_replan(d.target, reason)
        return entry

    def _keep(self, e: PlannerEntry) -> PlannerEntry:
        self.entries.append(e)
        self.counts[e.action] += 1
        self.metrics.labels(self.decisions, outcome=e.action).inc()
        log.info("[planner] %.1fs: %s %s%s (%s); window %d arrivals, p TTFT %s, TPOT %s, %d "
                 "waiting; %.2fs", e.at_s, e.action, e.current,
                 f" -> {e.target}" if e.target != e.current else "", e.reason,
                 e.window["arrivals"], e.window["ttft_p_s"], e.window["tpot_p_s"],
                 e.window["waiting"], e.decide_s)
        return e

    def view(self) -> dict:
        """``GET /planner``: the assignment it runs now, its settings, the decisions so far by
        outcome and the latest ``KEEP``, oldest first."""
        p = self.planner
        return dict(current=p.current, interval_s=self.interval_s, horizon_s=p.horizon_s,
                    switch_s=p.switch_s, min_gain=p.min_gain, dwell_s=p.dwell_s,
                    confirm=p.confirm, counts=dict(self.counts),
                    decisions=[asdict(e) for e in self.entries])
