"""Deployment planner (MegaScale-Infer Algorithm 1): enumerate tp_a, tp_e, n_a, n_e and m,
binary-search the largest global batch B under the TPOT SLO and memory, rank by tokens per
dollar (then tokens/s). Homogeneous, or heterogeneous with attention and expert hardware each
drawn from the given profiles.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Optional

from megainfer.config import ConfigError
from megainfer.perfmodel.model.colocated import ColocatedModel, ColocatedPlan
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.hardware import HardwareProfile
from megainfer.perfmodel.model.layer_times import layer_times_for
from megainfer.perfmodel.model.shapes import ModelShape

GiB = 1 << 30


class PlanError(ConfigError):
    """No plan satisfies the constraints; the message names the binding one."""


class SloUnreachableError(PlanError):
    pass


class ModelTooLargeError(PlanError):
    pass


@dataclass(frozen=True)
class SearchSpace:
    tpot_slo_s: float
    tp_choices: tuple = (1, 2, 4, 8)
    replica_choices: tuple = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32)
    micro_batches: tuple = (1, 2, 3, 4)
    expert_ranks: tuple = ()  # empty: every divisor of num_experts
    max_batch: int = 1 << 16
    devices_per_node: int = 8
    max_devices: int = 0  # 0: no limit

    def __post_init__(self):
        if not (self.tpot_slo_s > 0):
            raise ConfigError(f"slo.tpot_ms={self.tpot_slo_s * 1e3!r}: must be > 0")
        for n in ("tp_choices", "replica_choices", "micro_batches"):
            v = getattr(self, n)
            if not v or any(not (isinstance(x, int) and x >= 1) for x in v):
                raise ConfigError(f"search.{n}={v!r}: must be non-empty positive integers")
        if self.max_batch < 1:
            raise ConfigError(f"search.max_batch={self.max_batch!r}: must be >= 1")


@dataclass(frozen=True)
class Ranked:
    pred: object  # Prediction or ColocatedPrediction
    binding: str  # what stopped the batch from growing: tpot_slo | kv_memory | max_batch


@dataclass
class _Failures:
    expert_memory: Optional[tuple] = None  # (need bytes, capacity, label) of the smallest need
    attn_memory: Optional[tuple] = None
    best_tpot: Optional[tuple] = None  # (tpot seconds, label)

    def note(self, kind: str, value: float, cap: float, label: str) -> None:
        cur = getattr(self, kind)
        if cur is None or value < cur[0]:
            setattr(self, kind, (value, cap, label))


def largest_batch(predict: Callable[[int], object], step: int, k_max: int, slo: float):
    """Largest B = k*step (1 <= k <= k_max) with TPOT <= slo, by binary search (TPOT grows with B).

    Returns (prediction at that B, None) or (None, prediction at B=step) when even that misses."""
    lo = predict(step)
    if lo.t_iter > slo:
        return None, lo
    a, b = 1, k_max  # invariant: k=a meets the SLO
    best = lo
    while a < b:
        mid = (a + b + 1) // 2
        p = predict(mid * step)
        if p.t_iter <= slo:
            a, best = mid, p
        else:
            b = mid - 1
    return best, None


def _binding(k: int, k_mem: int, k_cap: int) -> str:
    if k < min(k_mem, k_cap):
        return "tpot_slo"
    return "kv_memory" if k_mem <= k_cap else "max_batch"


def search_disaggregated(model: DisaggModel, space: SearchSpace, fails: _Failures) -> list[Ranked]:
    s = model.shape
    cap_a = model.hw_a.mem_bytes * model.hw_a.mem_util
    cap_e = model.hw_e.mem_bytes * model.hw_e.mem_util
    n_es = space.expert_ranks or tuple(d for d in range(1, s.num_experts + 1) if s.num_experts % d == 0)
    tps_a = [t for t in space.tp_choices if t <= space.devices_per_node and s.num_heads % t == 0]
    tps_e = [t for t in space.tp_choices if t <= space.devices_per_node
             and s.moe_intermediate_size % t == 0]
    out = []
    for tp_a, tp_e, n_e, n_a, m in itertools.product(tps_a, tps_e, n_es, space.replica_choices,
                                                     space.micro_batches):
        base = Plan(tp_a, n_a, tp_e, n_e, m, 0, model.hw_a.name, model.hw_e.name)
        if space.max_devices and base.devices > space.max_devices:
            continue
        need_e = model.mem_expert(base)
        if need_e > cap_e:
            fails.note("expert_memory", need_e, cap_e, base.label())
            continue
        seqs, w, per_seq = model.attention_seqs(base, cap_a)
        k_mem, k_cap = seqs // m, space.max_batch // (m * n_a)
        if k_mem < 1:
            fails.note("attn_memory", w + m * per_seq, cap_a, base.label())
            continue
        if k_cap < 1:
            continue
        pred, miss = largest_batch(lambda b: model.predict(replace(base, batch=b)), m * n_a,
                                   min(k_mem, k_cap), space.tpot_slo_s)
        if pred is None:
            if fails.best_tpot is None or miss.t_iter < fails.best_tpot[0]:
                fails.best_tpot = (miss.t_iter, 0, miss.plan.label() + f" m={m}")
            continue
        out.append(Ranked(pred, _binding(pred.plan.batch // (m * n_a), k_mem, k_cap)))
    return out


def search_colocated(model: ColocatedModel, space: SearchSpace, fails: _Failures) -> list[Ranked]:
    s, cap = model.shape, model.hw.mem_bytes * model.hw.mem_util
    out = []
    for g, m in itertools.product(space.tp_choices, (1, 2)):
        if g > space.devices_per_node or s.num_heads % g:
            continue
        try:
            model.expert_split(g)
        except ConfigError:
            continue
        base = ColocatedPlan(g, m, 0, model.hw.name)
        w = model.mem(base)
        per_seq = model.mem(replace(base, batch=1)) - w
        k_mem = int((cap - w) // per_seq) // m if cap > w else 0
        k_cap = space.max_batch // m
        if k_mem < 1:
            fails.note("attn_memory", w + m * per_seq, cap, base.label())
            continue
        pred, miss = largest_batch(lambda b: model.predict(replace(base, batch=b)), m,
                                   min(k_mem, k_cap), space.tpot_slo_s)
        if pred is None:
            if fails.best_tpot is None or miss.t_iter < fails.best_tpot[0]:
                fails.best_tpot = (miss.t_iter, 0, base.label())
            continue
        out.append(Ranked(pred, _binding(pred.plan.batch // m, k_mem, k_cap)))
    return out


def _rank(plans: list[Ranked]) -> list[Ranked]:
    return sorted(plans, key=lambda r: (r.pred.tokens_per_dollar, r.pred.tokens_per_s), reverse=True)


def _raise_for(fails: _Failures, space: SearchSpace, what: str) -> None:
    if fails.best_tpot is not None:
        t, _, label = fails.best_tpot
        raise SloUnreachableError(
            f"slo.tpot_ms={space.tpot_slo_s * 1e3:g}: unreachable for {what}; the fastest plan "
            f"({label}) needs {t * 1e3:.3g} ms per token even at the smallest batch")
    # attention memory is only checked on plans whose experts fit, so it is the binding one if set
    for kind, part in (("attn_memory", "attention weights + KV"), ("expert_memory", "expert weights")):
        f = getattr(fails, kind)
        if f is not None:
            need, cap, label = f
            raise ModelTooLargeError(
                f"memory: model too large for {what}: {part} need {need / GiB:.3g} GiB per device "
                f"even in the most spread plan ({label}), usable capacity {cap / GiB:.3g} GiB")
    raise PlanError(f"search: no plan to evaluate for {what} (check search.max_devices / tp_choices)")


def plan_disaggregated(shape: ModelShape, profiles: list[HardwareProfile], workload: Workload,
                       space: SearchSpace, dtype: str = "bfloat16", heterogeneous: bool = True,
                       use_fit: bool = True) -> list[Ranked]:
    """Best plans first. With two profiles and heterogeneous=True, attention and expert hardware
    are each drawn from the profiles (all four pairings)."""
    if not profiles:
        raise ConfigError("hardware: at least one profile is needed")
    pairs = (list(itertools.product(profiles, profiles)) if heterogeneous
             else [(p, p) for p in profiles])
    fails, out = _Failures(), []
    for hw_a, hw_e in pairs:
        model = DisaggModel(shape, layer_times_for(hw_a, shape, dtype, use_fit),
                            layer_times_for(hw_e, shape, dtype, use_fit), workload, dtype)
        out += search_disaggregated(model, space, fails)
    if not out:
        _raise_for(fails, space, f"model {shape.name!r} on {'/'.join(p.name for p in profiles)}")
    return _rank(out)


def plan_colocated(shape: ModelShape, hw: HardwareProfile, workload: Workload, space: SearchSpace,
                   dtype: str = "bfloat16", use_fit: bool = True) -> list[Ranked]:
    fails = _Failures()
    model = ColocatedModel(shape, layer_times_for(hw, shape, dtype, use_fit), workload, dtype)
    out = search_colocated(model, space, fails)
    if not out:
        _raise_for(fails, space, f"colocated model {shape.name!r} on {hw.name}")
    return _rank(out)
