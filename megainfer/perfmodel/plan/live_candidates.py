"""The live planner's evaluator: every role assignment of the same N ranks (AE splits, PD splits:
``world_serving.candidates``) simulated at a forecast load, the requests' TTFT and TPOT scaled by
the planner's corrections before the SLOs judge them. ``ServingPins(prefill_replicas=0)`` keeps
it to the attention:expert splits a running job can switch between; ``ReachableAssignments``
simulates every split and keeps those (``Switchable``), naming a better one it cannot reach.
docs/replan.md, "The live planner"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megainfer.perfmodel.model.hardware import HardwareProfile
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.plan.goodput import Slo, attainment, simulate_ae, simulate_pd
from megainfer.perfmodel.plan.goodput_search import alternate_families
from megainfer.perfmodel.plan.live_planner import TIE, Corrections, Load, Prediction
from megainfer.perfmodel.plan.world_plan import _slots
from megainfer.perfmodel.plan.world_serving import (ServingChoice, ServingPins, ServingTarget,
                                                    candidates)
from megainfer.perfmodel.sim.events import LengthDist, poisson_requests
from megainfer.perfmodel.sim.job import JobConfig


def decode_label(n_a: int, n_e: int, m: int, tp_a: int = 1) -> str:
    """``a1e2m2`` (``a1t2e2m2`` with attention TP 2): the attention:expert split's name."""
    return f"a{n_a}{f't{tp_a}' if tp_a > 1 else ''}e{n_e}m{m}"


def assignment_label(c: ServingChoice) -> str:
    """``a1e2m2``; PD: ``p1+a1e1m2`` (``t2`` after a count with TP 2)."""
    p = c.plan
    decode = decode_label(p.n_a, p.n_e, p.m, p.tp_a)
    if c.pool is None:
        return decode
    n_p, tp_p = c.prefill
    return f"p{n_p}{f't{tp_p}' if tp_p > 1 else ''}+{decode}"


def assignment_deploy(c: ServingChoice) -> dict:
    """The ``deploy.*`` counts that run ``c``."""
    p, (n_p, tp_p) = c.plan, c.prefill
    return dict(attention_replicas=p.n_a, attention_tp=p.tp_a, expert_ranks=p.n_e,
                micro_batches=p.m, prefill_replicas=n_p, prefill_tp=tp_p)


@dataclass
class SimulatedAssignments:
    """``__call__(load, corrections, current, alone)``: the predictions of the candidates, the
    ``current`` assignment always among them (``alone``: it only); at most ``max_sims``
    simulations a call, families taking turns."""

    shape: ModelShape
    hw: HardwareProfile
    world: int
    slo: Slo
    max_num_seqs: int
    max_num_batched_tokens: int
    pins: ServingPins = ServingPins()
    dtype: str = "float32"
    num_requests: int = 200
    max_sims: int = 8
    seed: int = 0

    def __call__(self, load: Load, corr: Corrections, current: str, alone: bool = False
                 ) -> list[Prediction]:
        rate = max(load.rate, 1e-6)  # an idle forecast: a trickle, every plan meets it
        reqs = poisson_requests(self.num_requests, rate,
                                LengthDist("fixed", max(1, round(load.prompt_len))),
                                LengthDist("fixed", max(1, round(load.output_len))), self.seed)
        target = ServingTarget(reqs, self.slo, self.max_num_seqs, self.max_num_batched_tokens)
        models: dict = {}
        cands = candidates(self.shape, self.hw, target, self.world, self.pins, self.dtype,
                           models=models)
        picked = [c for c in cands if assignment_label(c) == current]
        if not alone:
            rest = [c for c in alternate_families(cands, ("AE", "PD"))
                    if assignment_label(c) != current]
            picked += rest[:max(0, self.max_sims - len(picked))]
        return [self._predict(c, target, corr, models) for c in picked]

    def _predict(self, c: ServingChoice, target: ServingTarget, corr: Corrections,
                 models: dict) -> Prediction:
        cfg = JobConfig(max_num_seqs=c.batch_limit, seed=self.seed, max_iterations=200_000,
                        max_num_batched_tokens=target.max_num_batched_tokens)
        model = models[_slots(self.shape, c.plan.n_e).num_experts]
        t = (simulate_pd(c.pool, model, c.plan, target.requests, cfg, self.dtype) if c.pool
             else simulate_ae(model, c.plan, target.requests, cfg))
        a = attainment(t.arrival_s, t.ttft_s * corr.ttft, t.tpot_s * corr.tpot, t.finish_s,
                       self.slo)
        headroom = max(a.ttft_p / self.slo.ttft_s, a.tpot_p / self.slo.tpot_s)
        return Prediction(assignment_label(c), a.ttft_p, a.tpot_p, a.goodput_req_s, headroom,
                          assignment_deploy(c))


@dataclass
class ReachableAssignments:
    """``inner``'s predictions kept to the assignments a running job can switch to
    (``reachable(prediction)``); the best of the others (more goodput than every kept one,
    beyond ``TIE``) is kept in ``better_unreachable`` for the decision to name, None when there
    is none."""

    inner: SimulatedAssignments
    reachable: Callable[[Prediction], bool]
    better_unreachable: Optional[Prediction] = None

    def __call__(self, load: Load, corr: Corrections, current: str, alone: bool = False
                 ) -> list[Prediction]:
        preds = self.inner(load, corr, current, alone)
        if alone:
            return preds
        kept = [p for p in preds if self.reachable(p)]
        out = [p for p in preds if not self.reachable(p)]
        top = max((p.goodput_req_s for p in kept), default=0.0)
        best = max(out, key=lambda p: p.goodput_req_s, default=None)
        self.better_unreachable = best if best is not None and \
            best.goodput_req_s > top * (1 + TIE) else None
        return kept


@dataclass(frozen=True)
class Switchable:
    """The assignments online re-planning switches between today: A:E splits of the same
    ``world`` ranks, attention TP 1, no prefill ranks, at most ``num_experts`` expert ranks,
    1..4 micro-batches (the measured decisions' range; ``micro_batches``: that count only).
    A value, so a planner holding it pickles (``serve/planner_child.py``)."""

    world: int
    num_experts: int
    micro_batches: Optional[int] = None

    def __call__(self, p: Prediction) -> bool:
        d = p.deploy
        return (d.get("prefill_replicas", 0) == 0 and d.get("attention_tp", 1) == 1
                and d["attention_replicas"] + d["expert_ranks"] == self.world
                and d["expert_ranks"] <= self.num_experts and 1 <= d["micro_batches"] <= 4
                and self.micro_batches in (None, d["micro_batches"]))
