"""Workload + SLOs + per-role hardware -> the plan with the most goodput per dollar, checked in
the job simulator.

Two families: AE (prefill chunked into the decode batches on the same ranks) and PD (a prefill
pool feeding an AE decode pool, simulated as one job: ``goodput.simulate_pd``). Every decode
split (tp_a, n_a, tp_e, n_e, m) first goes through the closed form: memory, the largest batch
whose iteration meets the TPOT SLO, and the token rate it sustains against the workload's.
Prefill pools are pruned on memory, TTFT, a stable queue and their own queue simulation. The
survivors are simulated best bound first (rate / cost bounds a candidate's requests per dollar)
until no unsimulated candidate can beat the best found.
docs/perfmodel.md, "Goodput planning".
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import Plan, Workload
from megainfer.perfmodel.model.hardware import HardwareProfile
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.plan.goodput import Attainment, Slo, attainment, simulate_ae, simulate_pd
from megainfer.perfmodel.plan.planner import PlanError, largest_batch
from megainfer.perfmodel.sim.events import Requests
from megainfer.perfmodel.sim.job import JobConfig

BOUNDS = ("memory", "TPOT", "TTFT")


@dataclass(frozen=True)
class Roles:
    prefill: HardwareProfile
    attention: HardwareProfile
    experts: HardwareProfile


@dataclass(frozen=True)
class GoodputSpace:
    tp_choices: tuple = (1, 2, 4, 8)
    replica_choices: tuple = (1, 2, 3, 4, 6, 8)
    prefill_replicas: tuple = (1, 2, 3, 4, 6, 8)
    micro_batches: tuple = (1, 2, 3, 4)
    expert_ranks: tuple = ()  # empty: every divisor of num_experts
    max_batch: int = 1024  # per attention replica
    devices_per_node: int = 8
    max_num_batched_tokens: int = 2048  # the decode/AE scheduler's token budget per step
    max_sims: int = 12  # simulations at most (each runs the whole workload), families alternating
    keep: int = 3  # simulate until no candidate left can beat the keep-th best
    families: tuple = ("AE", "PD")

    def __post_init__(self):
        for n in ("tp_choices", "replica_choices", "prefill_replicas", "micro_batches"):
            v = getattr(self, n)
            if not v or any(not (isinstance(x, int) and x >= 1) for x in v):
                raise ConfigError(f"goodput.{n}={v!r}: must be non-empty positive integers")
        for n in ("max_batch", "max_num_batched_tokens", "max_sims", "keep"):
            if not (isinstance(getattr(self, n), int) and getattr(self, n) >= 1):
                raise ConfigError(f"goodput.{n}={getattr(self, n)!r}: must be an integer >= 1")
        if not self.families or set(self.families) - {"AE", "PD"}:
            raise ConfigError(f"goodput.families={list(self.families)!r}: must be AE and/or PD")


@dataclass
class Candidate:
    family: str
    decode: Plan  # batch = the closed form's batch limit (all replicas)
    pool: Optional[PrefillPool] = None
    t_iter: float = 0.0  # closed-form TPOT at the batch limit
    result: Optional[Attainment] = None
    ruled_out: str = ""  # memory | TPOT | TTFT after the simulation missed

    @property
    def devices(self) -> int:
        return self.decode.devices + (self.pool.devices if self.pool else 0)

    @property
    def cost_per_hour(self) -> float:
        return self.decode_cost + (self.pool.cost_per_hour if self.pool else 0.0)

    decode_cost: float = 0.0
    offload: float = 0.0  # PD: the decode-attention offload ratio simulated (0: off; goodput_offload)

    def label(self) -> str:
        d = f"{self.decode.label()} m={self.decode.m} batch<={self.decode.batch // self.decode.n_a}/replica"
        if self.offload:
            d += f" offload={self.offload:g}"
        return f"{self.pool.label()} -> {d}" if self.pool else d

    def per_dollar(self) -> float:
        g = self.result.goodput_req_s if self.result else 0.0
        return g * 3600 / self.cost_per_hour if self.cost_per_hour > 0 else g * 3600 / self.devices


@dataclass
class Outcome:
    ranked: list  # feasible candidates, best first
    ruled: dict = field(default_factory=dict)  # family -> bound -> count
    notes: dict = field(default_factory=dict)  # family -> bound -> the closest miss, in words
    simulated: int = 0
    unsimulated: int = 0  # closed-form survivors left over when goodput.max_sims ran out
    candidates: list = field(default_factory=list)  # every candidate, cheapest first
    offloaded: list = field(default_factory=list)  # the offloaded variants simulated (goodput_offload)


def _note(out: Outcome, family: str, bound: str, gap: float, text: str) -> None:
    out.ruled.setdefault(family, dict.fromkeys(BOUNDS, 0))[bound] += 1
    cur = out.notes.setdefault(family, {}).get(bound)
    if cur is None or gap < cur[0]:
        out.notes[family][bound] = (gap, text)


def _decode_splits(shape: ModelShape, roles: Roles, wl: Workload, rate: float, slo: Slo,
                   space: GoodputSpace, dtype: str, use_fit: bool, out: Outcome, families) -> list:
    """Closed-form survivors: (Plan at its TPOT batch limit, t_iter, cost/h)."""
    model = decode_model(shape, roles.attention, roles.experts, wl, dtype, use_fit)
    cap_a = roles.attention.mem_bytes * roles.attention.mem_util
    cap_e = roles.experts.mem_bytes * roles.experts.mem_util
    n_es = space.expert_ranks or tuple(d for d in range(1, shape.num_experts + 1)
                                       if shape.num_experts % d == 0)
    tps_a = [t for t in space.tp_choices if t <= space.devices_per_node and shape.num_heads % t == 0]
    tps_e = [t for t in space.tp_choices if t <= space.devices_per_node
             and shape.moe_intermediate_size % t == 0]
    need = rate * wl.output_len  # tokens/s the decode pool must sustain
    keep = []
    for tp_a, tp_e, n_e, n_a, m in itertools.product(tps_a, tps_e, n_es, space.replica_choices,
                                                     space.micro_batches):
        base = Plan(tp_a, n_a, tp_e, n_e, m, 0, roles.attention.name, roles.experts.name)
        lbl = f"{base.label()} m={m}"
        need_e = model.mem_expert(base)
        seqs, w, per_seq = model.attention_seqs(base, cap_a)
        if need_e > cap_e or seqs < m:
            for f in families:
                _note(out, f, "memory", max(need_e / cap_e, (w + m * per_seq) / cap_a),
                      f"{lbl} needs {max(need_e / cap_e, (w + m * per_seq) / cap_a):.2f}x its memory")
            continue
        k_max = min(seqs, space.max_batch) // m
        pred, miss = largest_batch(lambda b: model.predict(replace(base, batch=b)), m * n_a, k_max,
                                   slo.tpot_s)
        if pred is None:
            for f in families:
                _note(out, f, "TPOT", miss.t_iter / slo.tpot_s, f"{lbl}: {miss.t_iter * 1e3:.3g} ms "
                      f"per token at its smallest batch > slo.tpot_ms={slo.tpot_s * 1e3:g}")
            continue
        if pred.tokens_per_s < need:
            for f in families:
                _note(out, f, "TPOT", need / pred.tokens_per_s, f"{lbl}: at most "
                      f"{pred.tokens_per_s:.4g} tok/s within the TPOT SLO, the workload needs "
                      f"{need:.4g}")
            continue
        keep.append((pred.plan, pred.t_iter, pred.cost_per_hour))
    return keep


def _prefill_pools(shape: ModelShape, hw: HardwareProfile, reqs: Requests, slo: Slo,
                   space: GoodputSpace, dtype: str, use_fit: bool, out: Outcome) -> list:
    cap = hw.mem_bytes * hw.mem_util
    p_max, p_mean = int(reqs.prompt_len.max()), float(reqs.prompt_len.mean())
    span = float(reqs.arrival_s.max() - reqs.arrival_s.min())
    rate = (len(reqs) - 1) / span if span > 0 else math.inf
    keep = []
    for tp, n in itertools.product(space.tp_choices, space.prefill_replicas):
        if tp > space.devices_per_node or shape.num_heads % tp:
            continue
        pool = PrefillPool(shape, hw, n, tp, dtype, use_fit)
        if pool.mem_need(p_max) > cap:
            _note(out, "PD", "memory", pool.mem_need(p_max) / cap,
                  f"{pool.label()} needs {pool.mem_need(p_max) / cap:.2f}x its memory")
            continue
        t_mean = pool.t_prefill(p_mean)
        if t_mean > slo.ttft_s or rate * t_mean / n >= 1:
            _note(out, "PD", "TTFT", max(t_mean / slo.ttft_s, rate * t_mean / n),
                  f"{pool.label()}: prefill of a mean prompt {t_mean * 1e3:.3g} ms, load "
                  f"{rate * t_mean / n:.2f} of its capacity (slo.ttft_ms={slo.ttft_s * 1e3:g})")
            continue
        ttft = pool.serve(reqs.arrival_s, reqs.prompt_len) - reqs.arrival_s
        frac = float((ttft <= slo.ttft_s).mean())
        if frac < slo.percentile / 100:
            _note(out, "PD", "TTFT", np.percentile(ttft, slo.percentile) / slo.ttft_s,
                  f"{pool.label()}: TTFT p{slo.percentile:g} {np.percentile(ttft, slo.percentile) * 1e3:.3g} ms "
                  f"in its queue > slo.ttft_ms={slo.ttft_s * 1e3:g}")
            continue
        keep.append(pool)
    return keep


def search_goodput(shape: ModelShape, roles: Roles, reqs: Requests, slo: Slo,
                   space: GoodputSpace = GoodputSpace(), dtype: str = "bfloat16",
                   use_fit: bool = True, seed: int = 0, offload_ratios: tuple = ()) -> Outcome:
    """Feasible candidates ranked by goodput per dollar (``Outcome.ranked``); raises PlanError
    naming, per family, the bound (memory, TPOT, TTFT) that ruled its candidates out.
    ``offload_ratios``: the best simulated PD candidate also runs with its decode attention
    offloaded at each (``goodput_offload.add_offload``, one simulation each)."""
    out = Outcome([])
    wl = mean_workload(reqs)
    span = float(reqs.arrival_s.max() - reqs.arrival_s.min())
    rate = (len(reqs) - 1) / span if span > 0 else len(reqs) / max(slo.ttft_s, 1e-9)
    fams = tuple(space.families)
    splits = _decode_splits(shape, roles, wl, rate, slo, space, dtype, use_fit, out, fams)
    cands = []
    if "AE" in fams:
        cands += [Candidate("AE", p, None, t, decode_cost=c) for p, t, c in splits]
    if "PD" in fams:
        pools = _prefill_pools(shape, roles.prefill, reqs, slo, space, dtype, use_fit, out)
        pools = sorted(pools, key=lambda p: p.cost_per_hour)[:3]  # the cheapest that meet TTFT
        cands += [Candidate("PD", p, pool, t, decode_cost=c) for (p, t, c), pool
                  in itertools.product(splits, pools)]
    ae_model = decode_model(shape, roles.attention, roles.experts, wl, dtype, use_fit)
    tops: list = []  # requests per dollar of the best ``space.keep`` feasible plans so far
    order = sorted(cands, key=lambda c: (c.cost_per_hour, c.devices, c.label()))
    for c in alternate_families(order, fams):
        bound = rate * 3600 / c.cost_per_hour if c.cost_per_hour > 0 else math.inf
        if len(tops) >= space.keep and bound <= tops[-1]:
            continue
        if out.simulated >= space.max_sims:
            out.unsimulated += 1
            continue
        cfg = JobConfig(max_num_seqs=max(1, c.decode.batch // c.decode.n_a),
                        max_num_batched_tokens=space.max_num_batched_tokens, seed=seed,
                        max_iterations=200_000)
        t = (simulate_pd(c.pool, ae_model, c.decode, reqs, cfg, dtype) if c.pool else
             simulate_ae(ae_model, c.decode, reqs, cfg))
        out.simulated += 1
        c.result = attainment(t.arrival_s, t.ttft_s, t.tpot_s, t.finish_s, slo)
        if c.result.ok:
            out.ranked.append(c)
            tops = sorted(tops + [c.per_dollar()], reverse=True)[:space.keep]
        else:
            c.ruled_out = c.result.missed_bound(slo)
            v = c.result.ttft_p / slo.ttft_s if c.ruled_out == "TTFT" else c.result.tpot_p / slo.tpot_s
            _note(out, c.family, c.ruled_out, v, f"{c.label()}: simulated {c.ruled_out} "
                  f"p{slo.percentile:g} {(c.result.ttft_p if c.ruled_out == 'TTFT' else c.result.tpot_p) * 1e3:.3g} ms, "
                  f"{100 * c.result.fraction:.0f}% of requests meet both SLOs")
    out.ranked.sort(key=lambda c: (-c.per_dollar(), c.cost_per_hour, c.label()))
    out.candidates = order  # every candidate, for "why bound here"
    if offload_ratios:
        from megainfer.perfmodel.plan.goodput_offload import add_offload  # it builds on this module
        add_offload(out, shape, roles, reqs, slo, space, dtype, use_fit, seed, offload_ratios)
    if not out.ranked:
        raise PlanError(no_plan_message(out, fams, rate, slo))
    return out


def mean_workload(reqs: Requests) -> Workload:
    """The closed form's workload: the requests' mean prompt and output lengths."""
    return Workload(max(1, round(float(reqs.prompt_len.mean()))),
                    max(1, round(float(reqs.output_len.mean()))))


def alternate_families(order: list, fams) -> list:
    """Cheapest first within each family, the families taking turns (so a family whose
    cheapest plans all miss cannot use up every simulation)."""
    lists = [[c for c in order if c.family == f] for f in fams]
    return [c for row in itertools.zip_longest(*lists) for c in row if c is not None]


def no_plan_message(out: Outcome, fams, rate: float, slo: Slo) -> str:
    parts = []
    for f in fams:
        counts = out.ruled.get(f, dict.fromkeys(BOUNDS, 0))
        ruled = ", ".join(f"{b} {counts[b]}" for b in BOUNDS if counts[b])
        close = "; ".join(f"{b}: closest {out.notes[f][b][1]}" for b in BOUNDS
                          if b in out.notes.get(f, {}))
        parts.append(f"{f} plans ruled out by {ruled or 'nothing (none enumerated)'}"
                     + (f" ({close})" if close else ""))
    return (f"no feasible plan at workload.arrival_rate={rate:.4g}/s with slo.ttft_ms="
            f"{slo.ttft_s * 1e3:g}, slo.tpot_ms={slo.tpot_s * 1e3:g} at p{slo.percentile:g}: "
            + " | ".join(parts) + (f" | {out.unsimulated} candidates passed the closed form but "
                                   f"were not simulated (goodput.max_sims)" if out.unsimulated else ""))


def why_bound(out: Outcome, slo: Slo) -> list[str]:
    """Why the best plan is where it is: its SLO headroom, and what stopped every cheaper one."""
    b = out.ranked[0]
    r = b.result
    lines = [f"best: TTFT p{slo.percentile:g} {r.ttft_p * 1e3:.4g} ms = {100 * r.ttft_p / slo.ttft_s:.0f}% "
             f"of slo.ttft_ms, TPOT p{slo.percentile:g} {r.tpot_p * 1e3:.4g} ms = "
             f"{100 * r.tpot_p / slo.tpot_s:.0f}% of slo.tpot_ms; {100 * r.fraction:.0f}% of requests "
             f"meet both; decode batch limit {b.decode.batch // b.decode.n_a}/replica from the TPOT SLO"]
    cheaper = [c for c in out.candidates if c.cost_per_hour < b.cost_per_hour and c.result is not None
               and not c.result.ok]
    if cheaper:
        by = {}
        for c in cheaper:
            by.setdefault(c.ruled_out, []).append(c)
        lines.append("cheaper simulated plans miss: " + "; ".join(
            f"{k} ({len(v)}, e.g. {v[0].label()})" for k, v in by.items()))
    for f, counts in out.ruled.items():
        if any(counts.values()):
            lines.append(f"{f} candidates pruned or missed: " +
                         ", ".join(f"{k} {v}" for k, v in counts.items() if v))
    return lines
