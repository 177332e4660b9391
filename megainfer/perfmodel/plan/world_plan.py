"""Exactly N ranks + one offline job -> disaggregated deploy plans, best first.

What ``megainfer-launch`` asks with ``deploy=auto`` (docs/perfmodel.md, "The planner at
launch"): split ``world`` ranks into ``n_a`` attention replicas of ``tp_a`` ranks and
``n_e = world - n_a * tp_a`` expert ranks, pick ``m`` micro-batches, and run the job's batch
(as many of its requests as the scheduler's per-replica limit and the KV memory allow) at the
fastest decode throughput B / T_iter. Any pinned dimension (an explicit ``deploy.*`` key) is
held fixed. Expert ranks need not divide the experts: the runtime then pads the slots up to a
multiple of the ranks with redundant replicas (``runtime/eplb/initial.py``), which is what the
model evaluates (``num_experts`` = slots). Pure arithmetic: a few hundred predictions, well
under a second for N <= 64.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Prediction, Workload
from megainfer.perfmodel.model.hardware import HardwareProfile
from megainfer.perfmodel.model.layer_times import layer_times_for
from megainfer.perfmodel.model.shapes import ModelShape

MICRO_BATCHES = (1, 2, 3, 4)


@dataclass(frozen=True)
class Pins:
    """Dimensions the user fixed (None: the planner chooses)."""

    attention_replicas: Optional[int] = None
    attention_tp: Optional[int] = None
    expert_ranks: Optional[int] = None
    micro_batches: Optional[int] = None

    def allows(self, n_a: int, tp_a: int, n_e: int, m: int) -> bool:
        return all(p is None or p == v for p, v in ((self.attention_replicas, n_a),
                   (self.attention_tp, tp_a), (self.expert_ranks, n_e), (self.micro_batches, m)))


@dataclass(frozen=True)
class JobLoad:
    """The offline job as the planner sees it."""

    requests: int  # how many sequences the job has in all
    max_seqs_per_replica: int  # scheduler.max_num_seqs
    workload: Workload  # mean prompt length, max_tokens

    def __post_init__(self):
        for n in ("requests", "max_seqs_per_replica"):
            v = getattr(self, n)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"job.{n}={v!r}: must be an integer >= 1")


@dataclass(frozen=True)
class WorldChoice:
    pred: Prediction
    batch_limit: int  # sequences per attention replica the plan runs at once
    binding: str  # what limits the batch: requests | max_num_seqs | kv_memory

    @property
    def plan(self) -> Plan:
        return self.pred.plan

    def describe(self) -> str:
        p = self.pred
        return (f"{p.plan.label()} m={p.plan.m} batch {p.plan.batch} ({self.batch_limit}/replica, "
                f"{self.binding}): T_a {p.t_a * 1e3:.3g} ms, T_e {p.t_e * 1e3:.3g} ms, T_c "
                f"{p.t_c * 1e3:.3g} ms, iteration {p.t_iter * 1e3:.3g} ms, "
                f"{p.tokens_per_s:.4g} tok/s")


class NoWorldPlanError(ConfigError):
    """No split of the world fits; the message names why (pins, memory)."""


def _tp_ok(shape: ModelShape, tp: int) -> bool:
    kv = shape.num_kv_heads
    return shape.num_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def _slots(shape: ModelShape, n_e: int) -> ModelShape:
    """The shape the runtime runs on n_e expert ranks: experts padded to a multiple of n_e."""
    slots = -(-shape.num_experts // n_e) * n_e
    return shape if slots == shape.num_experts else replace(shape, num_experts=slots)


def world_splits(shape: ModelShape, world: int, pins: Pins = Pins(),
                 micro_batches: tuple = MICRO_BATCHES, why: Optional[dict] = None):
    """(tp_a, n_a, n_e, m) of every disaggregated split of exactly ``world`` ranks that the
    heads, the experts and the pins allow (``why``: gets the reason a split was skipped)."""
    for tp_a in range(1, world):
        if not _tp_ok(shape, tp_a):
            continue
        for n_a in range(1, (world - 1) // tp_a + 1):
            n_e = world - n_a * tp_a
            if n_e > shape.num_experts:
                if why is not None:
                    why.setdefault("experts", f"{n_e} expert ranks > {shape.num_experts} experts")
                continue
            for m in micro_batches:
                if pins.allows(n_a, tp_a, n_e, m):
                    yield tp_a, n_a, n_e, m


def plan_world(shape: ModelShape, hw: HardwareProfile, job: JobLoad, world: int,
               pins: Pins = Pins(), dtype: str = "float32", use_fit: bool = True,
               micro_batches: tuple = MICRO_BATCHES) -> list[WorldChoice]:
    """Every feasible disaggregated split of exactly ``world`` ranks, fastest first."""
    if not (isinstance(world, int) and world >= 2):
        raise ConfigError(f"world size {world!r}: a disaggregated plan needs >= 2 ranks")
    cap = hw.mem_bytes * hw.mem_util
    out, why = [], {}
    times: dict = {}
    for tp_a, n_a, n_e, m in world_splits(shape, world, pins, micro_batches, why):
        s = _slots(shape, n_e)
        if s.num_experts not in times:
            t = layer_times_for(hw, s, dtype, use_fit)
            times[s.num_experts] = DisaggModel(s, t, t, job.workload, dtype)
        c = _choice(times[s.num_experts], Plan(tp_a, n_a, 1, n_e, m, 0), job, cap, why)
        if c is not None:
            out.append(c)
    if not out:
        given = {k: v for k, v in pins.__dict__.items() if v is not None}
        reasons = "; ".join(f"{k}: {v}" for k, v in why.items()) or "no split matches"
        raise NoWorldPlanError(f"deploy=auto: no disaggregated plan over {world} ranks for model "
                               f"{shape.name!r} on {hw.name}" + (f" with deploy pins {given}" if given
                                                                  else "") + f" ({reasons})")
    return sorted(out, key=lambda c: (-c.pred.tokens_per_s, c.plan.m, c.plan.n_a, c.plan.tp_a))


def _choice(model: DisaggModel, base: Plan, job: JobLoad, cap: float, why: dict):
    n_a, m = base.n_a, base.m
    need_e = model.mem_expert(base)
    if need_e > cap:
        why["memory"] = (f"expert weights need {need_e / 2**30:.3g} GiB per rank on "
                         f"{base.n_e} expert ranks, {cap / 2**30:.3g} GiB usable")
        return None
    mem_seqs, w, per_seq = model.attention_seqs(base, cap)
    if mem_seqs < 1:
        why["memory"] = (f"attention weights + one sequence's KV need "
                         f"{(w + per_seq) / 2**30:.3g} GiB per rank, {cap / 2**30:.3g} GiB usable")
        return None
    per_rep = -(-job.requests // n_a)
    limits = (("requests", per_rep), ("max_num_seqs", job.max_seqs_per_replica),
              ("kv_memory", mem_seqs))
    binding, b = min(limits, key=lambda x: x[1])
    if m > b:  # a micro-batch with no sequence in it is only overhead
        return None
    batch = min(job.requests, b * n_a)
    return WorldChoice(model.predict(replace(base, batch=batch)), b, binding)
