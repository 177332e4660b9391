"""Exactly N ranks + a serving target (request rate, lengths, SLOs) -> AE or PD plans, best first.

What ``deploy=auto`` asks when ``slo.arrival_rate`` is set. Two families over exactly ``world``
ranks, one device a rank (expert ranks are expert parallel only: ``tp_e = 1``): **AE** (``n_a``
attention replicas of ``tp_a`` ranks, ``world - n_a * tp_a`` expert ranks, prefill chunked into
the same iterations) and **PD** (``prefill_replicas x prefill_tp`` prefill ranks feeding an AE
decode pool over the ranks left). Each split runs at its decode batch limit (``slo.tpot_ms``,
``scheduler.max_num_seqs``, KV memory); the first ``max_sims`` by decode throughput, families
taking turns, are simulated on the same seeded Poisson requests and ranked by attaining the
SLOs, goodput, then headroom. ``offload_ratios``: the best simulated PD split also runs at
these decode-attention offload ratios (``sim.pd_offload``; its decode seats then bounded by
``max_num_seqs`` and the TPOT SLO, its local requests by the replica's KV memory), ranked by
the same rule. Pure arithmetic: every rank computes the same plan.
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
from megainfer.perfmodel.sim.pd_offload import Offload, RemoteAttention, kv_link

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
    offload: float = 0.0  # PD: the pd.offload_ratio simulated (0: off)
    decode_kv_tokens: Optional[int] = None  # offload: a decode replica's KV, tokens (local requests)
    offload_blocks: Optional[int] = None  # offload: a prefill replica's pool (half its KV), blocks

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
        if self.offload:
            d += f" offload={self.offload:g}"
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


@dataclass(frozen=True)
class _WithRoundTrips:
    """A prediction whose iteration also waits ``extra_s`` (the offload's round trips)."""

    pred: Prediction
    extra_s: float

    @property
    def t_iter(self) -> float:
        return self.pred.t_iter + self.extra_s


def _at_batch_limit(model: DisaggModel, base: Plan, target: ServingTarget, cap: float,
                    kv_bound: bool = True, extra_s=None):
    """The split at the largest batch per replica within max_num_seqs, the KV memory (unless
    not ``kv_bound``: offloaded requests keep their KV elsewhere) and (when some batch meets
    it) the TPOT SLO, each batch's iteration lengthened by ``extra_s(batch)`` s when given (the
    offload's round trips); None when its weights or one micro-batch do not fit."""
    if model.mem_expert(base) > cap:
        return None
    seats = model.attention_seqs(base, cap)[0]
    k_max = min(seats if kv_bound else target.max_num_seqs, target.max_num_seqs) // base.m
    if seats < 1:
        return None
    if k_max < 1:
        return None
    step = base.m * base.n_a
    if extra_s is None:
        predict = lambda b: model.predict(replace(base, batch=b))  # noqa: E731
    else:
        predict = lambda b: _WithRoundTrips(model.predict(replace(base, batch=b)), extra_s(b))  # noqa: E731
    pred, miss = largest_batch(predict, step, k_max, target.slo.tpot_s)
    pred = pred or miss  # no batch meets the TPOT SLO: the smallest, the simulation judges
    if extra_s is not None:
        pred = pred.pred
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
                       use_fit: bool = True, max_sims: int = MAX_SIMS, seed: int = 0,
                       offload_ratios: tuple = ()) -> list[ServingChoice]:
    """The simulated candidates, best first (attaining the SLOs, then goodput, then SLO
    headroom); raises ``NoWorldPlanError`` when no split of ``world`` ranks fits. The best
    simulated PD split also runs at every ratio > 0 of ``offload_ratios`` (one more
    simulation each)."""
    if not (isinstance(world, int) and world >= 2):
        raise NoWorldPlanError(f"world size {world!r}: a disaggregated plan needs >= 2 ranks")
    models: dict = {}
    cands = candidates(shape, hw, target, world, pins, dtype, use_fit, models)
    if not cands:
        raise NoWorldPlanError(f"deploy=auto: no AE or PD split of {world} ranks fits model "
                               f"{shape.name!r} on {hw.name} (memory, or the deploy pins)")
    rank = lambda cs: sorted(cs, key=lambda c: (not c.result.ok, -c.result.goodput_req_s,  # noqa: E731
                                                c.headroom(target.slo), c.label()))
    done = [simulate_choice(c, models[_slots(shape, c.plan.n_e).num_experts], target, dtype,
                            seed) for c in alternate_families(cands, ("AE", "PD"))[:max_sims]]
    pd = [c for c in rank(done) if c.pool]
    if pd and offload_ratios:  # the best PD split again, its decode attention offloaded
        model, wl = models[_slots(shape, pd[0].plan.n_e).num_experts], mean_workload(target.requests)
        for r in offload_ratios:
            v = offloaded_variant(pd[0], r, model, target, hw, wl) if r > 0 else None
            if v is not None:
                done.append(simulate_choice(v, model, target, dtype, seed))
    return rank(done)


def simulate_choice(c: ServingChoice, model: DisaggModel, target: ServingTarget, dtype: str,
                    seed: int) -> ServingChoice:
    """``c`` with its ``result``: the target's requests simulated on it."""
    cfg = JobConfig(max_num_seqs=c.batch_limit, seed=seed, max_iterations=200_000,
                    max_num_batched_tokens=target.max_num_batched_tokens)
    off = Offload(c.offload, c.offload_blocks)
    t = (simulate_pd(c.pool, model, c.plan, target.requests, cfg, dtype, off, c.decode_kv_tokens)
         if c.pool else simulate_ae(model, c.plan, target.requests, cfg))
    c.result = attainment(t.arrival_s, t.ttft_s, t.tpot_s, t.finish_s, target.slo)
    return c


def replica_kv_tokens(shape, hw: HardwareProfile, tp: int, dtype: str) -> float:
    """KV tokens a whole-model replica of ``tp`` devices on ``hw`` holds beside its weights
    (a prefill replica; the usable memory ``mem_bytes x mem_util``)."""
    cap = hw.mem_bytes * hw.mem_util
    return (cap - shape.total_weight_bytes(dtype) / tp) / shape.kv_bytes_per_token(dtype, tp)


def offload_pool_blocks(kv_tokens: float) -> int:
    """A prefill replica's offload pool in blocks: half its KV memory (``pd.offload_blocks``'
    default)."""
    return max(int(kv_tokens // 2) // Offload().block_size, 0)


def offloaded_variant(c: ServingChoice, ratio: float, model: DisaggModel, target: ServingTarget,
                      hw: HardwareProfile, wl: Workload) -> Optional[ServingChoice]:
    """PD split ``c`` with ``ratio`` of its requests' decode attention offloaded (``hw``: the
    decode attention's; the offload pool on ``c.pool.hw``): seats up to
    max_num_seqs and the TPOT SLO, each iteration predicted with its offloaded rows' round trip
    at every layer (``ratio`` of a micro-batch's rows, at the mean request's middle context, on
    an idle prefill replica: ``RemoteAttention.rows_s``, the link the PD simulator takes; the
    local attention's overlap not counted), the KV memory bounding its local requests only, as
    ``decode_kv_tokens``: the seats' KV at the mean request's whole life; each prefill
    replica's offload pool half of its KV memory (``pd.offload_blocks``' default)."""
    cap = hw.mem_bytes * hw.mem_util
    base = replace(c.plan, batch=0)
    seats = model.attention_seqs(base, cap)[0]
    pool, p = c.pool, c.plan
    remote = RemoteAttention(pool, model, *kv_link(pool, model, p.tp_a), Offload(ratio))
    ctx = wl.input_len + wl.output_len / 2
    trips = lambda b: pool.shape.num_layers * remote.rows_s(ratio * b / (p.n_a * p.m), ctx)  # noqa: E731
    v = _at_batch_limit(model, base, target, cap, kv_bound=False, extra_s=trips)
    if v is None or seats < 1:
        return None
    blocks = offload_pool_blocks(replica_kv_tokens(pool.shape, pool.hw, pool.tp_p, pool.dtype))
    life = int((target.requests.prompt_len + target.requests.output_len).max())
    return ServingChoice("PD", v.decode, v.batch_limit, pool, None, ratio,
                         max(seats * (wl.input_len + wl.output_len), life), blocks)
