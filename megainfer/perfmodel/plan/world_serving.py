"""Exactly N ranks + a serving target (request rate, lengths, SLOs) -> AE or PD plans, best first.

What ``deploy=auto`` asks when ``slo.arrival_rate`` is set. Two families over exactly ``world``
ranks, one device a rank (expert ranks are expert parallel only: ``tp_e = 1``): **AE** (``n_a``
attention replicas of ``tp_a`` ranks, ``world - n_a * tp_a`` expert ranks, prefill chunked into
the same iterations) and **PD** (``prefill_replicas x prefill_tp`` prefill ranks feeding an AE
decode pool over the ranks left). Each split runs at its decode batch limit (``slo.tpot_ms``,
``scheduler.max_num_seqs``, KV memory); the first ``max_sims`` by decode throughput, families
taking turns, are simulated on the same seeded Poisson requests and ranked by attaining the
SLOs, goodput, then headroom. Pure arithmetic: every rank computes the same plan.
docs/perfmodel.md, "Planning a server".
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Optional

from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Prediction, Workload
from megainfer.perfmodel.model.hardware import HardwareProfile
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.plan.goodput import Attainment, Slo, attainment, simulate_ae, simulate_pd
from megainfer.perfmodel.plan.goodput_search import alternate_families, mean_workload
from megainfer.perfmodel.plan.planner import largest_batch
from megainfer.perfmodel.plan.world_plan import (NoWorldPlanError, Pins, _slots, _tp_ok,
                                                 world_splits)
from megainfer.perfmodel.sim.events import Requests
from megainfer.perfmodel.sim.job import JobConfig

MAX_SIMS = 8  # simulations per launch (each runs the whole request sample)


@dataclass(frozen=True)
class ServingPins(Pins):
    """``Pins`` and the prefill side (``prefill_replicas=0``: AE only)."""

    prefill_replicas: Optional[int] = None
    prefill_tp: Optional[int] = None

    def allows_prefill(self, n_p: int, tp_p: int) -> bool:
        return all(p is None or p == v for p, v in ((self.prefill_replicas, n_p),
                                                    (self.prefill_tp, tp_p)))


@dataclass(frozen=True)
class ServingTarget:
    """What the deployment is planned for: the requests simulated and the SLOs they must meet;
    the scheduler's limits (the decode replicas' ``max_num_seqs``, the step's token budget)."""

    requests: Requests
    slo: Slo
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class ServingChoice:
    family: str  # AE | PD
    decode: Prediction  # the decode split at its batch limit (plan.batch: all replicas)
    batch_limit: int  # sequences per decode replica (the simulated scheduler's max_num_seqs)
    pool: Optional[PrefillPool] = None
    result: Optional[Attainment] = None

    @property
    def plan(self) -> Plan:
        return self.decode.plan

    @property
    def prefill(self) -> tuple[int, int]:
        """(prefill_replicas, prefill_tp); (0, 1) for AE."""
        return (self.pool.n_p, self.pool.tp_p) if self.pool else (0, 1)

    def headroom(self, slo: Slo) -> tuple[float, float]:
        """Each SLO's percentile over its bound, the tighter first (< 1: met with room)."""
        r = self.result
        return tuple(sorted((r.ttft_p / slo.ttft_s, r.tpot_p / slo.tpot_s), reverse=True))

    def label(self) -> str:
        p = self.plan
        d = f"{p.label()} m={p.m} batch<={self.batch_limit}/replica"
        return f"{self.pool.label()} -> {d}" if self.pool else d

    def describe(self, slo: Slo) -> str:
        r = self.result
        return (f"{self.family} {self.label()}: TTFT p{slo.percentile:g} {r.ttft_p * 1e3:.4g} ms, "
                f"TPOT p{slo.percentile:g} {r.tpot_p * 1e3:.4g} ms, {100 * r.fraction:.0f}% of "
                f"requests meet both, goodput {r.goodput_req_s:.4g} req/s")


def _decode_splits(shape: ModelShape, hw: HardwareProfile, wl: Workload, ranks: int,
                   pins: Pins, target: ServingTarget, dtype: str, use_fit: bool,
                   models: dict) -> list[ServingChoice]:
    """Every AE split of exactly ``ranks`` that fits in memory, at its decode batch limit."""
    cap = hw.mem_bytes * hw.mem_util
    out = []
    for tp_a, n_a, n_e, m in world_splits(shape, ranks, pins):
        s = _slots(shape, n_e)
        if s.num_experts not in models:
            models[s.num_experts] = decode_model(s, hw, hw, wl, dtype, use_fit)
        c = _at_batch_limit(models[s.num_experts],
                            Plan(tp_a, n_a, 1, n_e, m, 0, hw.name, hw.name), target, cap)
        if c is not None:
            out.append(c)
    return out


def _at_batch_limit(model: DisaggModel, base: Plan, target: ServingTarget, cap: float):
    """The split at the largest batch per replica within max_num_seqs, the KV memory and (when
    some batch meets it) the TPOT SLO; None when its weights or one micro-batch do not fit."""
    if model.mem_expert(base) > cap:
        return None
    k_max = min(model.attention_seqs(base, cap)[0], target.max_num_seqs) // base.m
    if k_max < 1:
        return None
    step = base.m * base.n_a
    pred, miss = largest_batch(lambda b: model.predict(replace(base, batch=b)), step, k_max,
                               target.slo.tpot_s)
    pred = pred or miss  # no batch meets the TPOT SLO: the smallest, the simulation judges
    return ServingChoice("AE", pred, pred.plan.batch // base.n_a)


def _prefill_pools(shape: ModelShape, hw: HardwareProfile, ranks: int, pins: ServingPins,
                   reqs: Requests, dtype: str, use_fit: bool) -> list[PrefillPool]:
    """Every prefill pool of exactly ``ranks`` whose replicas hold the model and the longest
    prompt, and whose queue is stable at the offered rate."""
    cap = hw.mem_bytes * hw.mem_util
    span = float(reqs.arrival_s.max() - reqs.arrival_s.min())
    rate = (len(reqs) - 1) / span if span > 0 else float("inf")
    out = []
    for tp in range(1, ranks + 1):
        if ranks % tp or not _tp_ok(shape, tp) or not pins.allows_prefill(ranks // tp, tp):
            continue
        pool = PrefillPool(shape, hw, ranks // tp, tp, dtype, use_fit)
        if pool.mem_need(int(reqs.prompt_len.max())) > cap:
            continue
        if rate * pool.t_prefill(float(reqs.prompt_len.mean())) / pool.n_p >= 1:
            continue
        out.append(pool)
    return out


def candidates(shape: ModelShape, hw: HardwareProfile, target: ServingTarget, world: int,
               pins: ServingPins = ServingPins(), dtype: str = "float32",
               use_fit: bool = True, models: Optional[dict] = None) -> list[ServingChoice]:
    """Every AE and PD split of exactly ``world`` ranks the closed form keeps, each family
    fastest decode first. ``models``: expert slots -> the decode model, filled as built."""
    reqs = target.requests
    wl, models = mean_workload(reqs), {} if models is None else models
    ae = [] if pins.prefill_replicas not in (None, 0) else \
        _decode_splits(shape, hw, wl, world, pins, target, dtype, use_fit, models)
    pd = []
    if pins.prefill_replicas != 0:
        for p_ranks in range(1, world - 1):  # the decode pool keeps >= 2 ranks
            pools = _prefill_pools(shape, hw, p_ranks, pins, reqs, dtype, use_fit)
            if not pools:
                continue
            splits = _decode_splits(shape, hw, wl, world - p_ranks, pins, target, dtype,
                                    use_fit, models)
            pd += [ServingChoice("PD", c.decode, c.batch_limit, pool)
                   for c, pool in itertools.product(splits, pools)]
    key = lambda c: (-c.decode.tokens_per_s, c.plan.m, c.label())  # noqa: E731
    return sorted(ae, key=key) + sorted(pd, key=key)


def plan_world_serving(shape: ModelShape, hw: HardwareProfile, target: ServingTarget,
                       world: int, pins: ServingPins = ServingPins(), dtype: str = "float32",
                       use_fit: bool = True, max_sims: int = MAX_SIMS,
                       seed: int = 0) -> list[ServingChoice]:
    """The simulated candidates, best first (attaining the SLOs, then goodput, then SLO
    headroom); raises ``NoWorldPlanError`` when no split of ``world`` ranks fits."""
    if not (isinstance(world, int) and world >= 2):
        raise NoWorldPlanError(f"world size {world!r}: a disaggregated plan needs >= 2 ranks")
    models: dict = {}
    cands = candidates(shape, hw, target, world, pins, dtype, use_fit, models)
    if not cands:
        raise NoWorldPlanError(f"deploy=auto: no AE or PD split of {world} ranks fits model "
                               f"{shape.name!r} on {hw.name} (memory, or the deploy pins)")
    done = []
    for c in alternate_families(cands, ("AE", "PD"))[:max_sims]:
        cfg = JobConfig(max_num_seqs=c.batch_limit, seed=seed, max_iterations=200_000,
                        max_num_batched_tokens=target.max_num_batched_tokens)
        model = models[_slots(shape, c.plan.n_e).num_experts]
        t = (simulate_pd(c.pool, model, c.plan, target.requests, cfg, dtype) if c.pool else
             simulate_ae(model, c.plan, target.requests, cfg))
        c.result = attainment(t.arrival_s, t.ttft_s, t.tpot_s, t.finish_s, target.slo)
        done.append(c)
    return sorted(done, key=lambda c: (not c.result.ok, -c.result.goodput_req_s,
                                       c.headroom(target.slo), c.label()))

