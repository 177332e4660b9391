"""Measured layer times + the work left -> whether to switch the attention:expert split now
(docs/replan.md, "Measure and decide").

Rank 0 calls ``decide`` every ``replan.interval`` iterations with the spans measured since the
last decision (``measure.py``). The per-layer model is refitted from them
(``perfmodel.model.insitu.fit_in_situ``), the traced T_c replaces the link's latency, and
``perfmodel.plan.world_plan.plan_world`` ranks every split of the same world for the work left,
replica TP held, the micro-batch count held or free (``replan.micro_batches``). It switches only
when the current plan's remaining time exceeds the best plan's plus the switch's cost (weights
and KV over ``replan.link_gbps``, one drained iteration) by more than ``replan.min_gain`` of it.

Pure arithmetic (no torch, no MPI): unit-tested with synthetic measurements."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import Workload
from megainfer.perfmodel.model.hardware import HardwareProfile, LayerFit
from megainfer.perfmodel.model.insitu import fit_in_situ
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.plan.world_plan import JobLoad, NoWorldPlanError, Pins, plan_world


@dataclass(frozen=True)
class Measurements:
    attn: tuple  # ((tokens, context, seconds), ...) per attention (layer, micro-batch)
    expert: tuple  # ((token-expert pairs, seconds), ...) per expert (layer, micro-batch)
    experts_on_rank: int  # slots an expert rank held while measured
    t_c: float = float("nan")  # seconds, one-way A2E; nan: not observed


@dataclass(frozen=True)
class JobState:
    """The work left, as rank 0 sees it."""

    requests: int  # running + waiting + not yet handed out
    context: int  # mean tokens a sequence attends over now
    output_left: int  # mean tokens each request has still to generate
    max_seqs_per_replica: int
    running_per_replica: tuple = ()  # sequences running on each replica now (KV to re-home)


@dataclass(frozen=True)
class Decision:
    switch: bool
    current: tuple  # (attention replicas, expert ranks)
    best: tuple
    t_current: float  # predicted seconds left on the current plan
    t_best: float  # predicted seconds left on the best plan, without the switch
    cost: float  # predicted seconds the switch costs
    gain: float  # (t_current - t_best - cost) / t_current
    reason: str
    micro_batches: tuple = (0, 0)  # (current, best); 0: not given

    def _name(self, split: tuple, m: int) -> str:
        changes = self.micro_batches[0] != self.micro_batches[1]
        return f"a{split[0]}e{split[1]}" + (f"m{m}" if changes else "")

    @property
    def label(self) -> str:
        return self._name(self.best, self.micro_batches[1])

    def describe(self) -> str:
        return (f"{self._name(self.current, self.micro_batches[0])} -> {self.label}: "
                f"{self.t_current:.3g} s left vs {self.t_best:.3g} s + switch {self.cost:.3g} s, "
                f"gain {100 * self.gain:.1f}% ({self.reason})")


def refit(meas: Measurements, dtype: str) -> LayerFit:
    """The per-layer fit of the measured spans (ConfigError: too few distinct sizes)."""
    k = fit_in_situ(list(meas.attn), list(meas.expert), meas.experts_on_rank)
    ctx = [c for _, c, _ in meas.attn]
    return LayerFit(k1=max(k["k1"], 0.0), k2=max(k["k2"], 0.0), k3=max(k["k3"], 0.0),
                    k4=max(k["k4"], 0.0), k1_ctx=max(k["k1_ctx"], 0.0),
                    ctx_ref=int(sum(ctx) / len(ctx)) if ctx else 0, dtype=dtype)


def measured_hardware(hw: HardwareProfile, shape: ModelShape, meas: Measurements,
                      dtype: str) -> HardwareProfile:
    """``hw`` with the refitted layer times for ``shape`` and, when traced, the measured T_c as
    the link's latency; the node's wake-up latency is then 0 (the traced time includes it: it
    runs to when the waiting rank had the message), so the planner's T_c of the current plan is
    the traced one plus the payload's time on the link."""
    out = replace(hw, fits={**hw.fits, shape.name: refit(meas, dtype)})
    if math.isfinite(meas.t_c) and meas.t_c > 0:
        out = replace(out, inter_link=replace(hw.inter_link, latency_s=meas.t_c),
                      node=replace(hw.node, wake_latency_s=0.0))
    return out


def switch_cost(shape: ModelShape, old: tuple, new: tuple, state: JobState, t_iter: float,
                link_Bps: float, dtype: str) -> float:
    """Seconds: weights and KV that move when ``old`` (n_a, n_e) becomes ``new``, plus one
    drained iteration. Ranks keep their order: ranks [min(n_a), max(n_a)) change role."""
    (a0, e0), (a1, e1) = old, new
    if (a0, e0) == (a1, e1):
        return 0.0
    E = shape.num_experts
    expert = shape.num_layers * shape.expert_bytes(dtype)  # one expert, all layers, as stored
    changed = abs(a1 - a0)
    moved = changed * expert * (math.ceil(E / e0) + math.ceil(E / e1))  # out of / into them
    if a1 > a0:  # expert -> attention: attention weights read in
        moved += changed * shape.attention_side_bytes(dtype)
    else:  # attention -> expert: the leaving replicas' running sequences' KV
        leaving = sum(state.running_per_replica[a1:a0]) if state.running_per_replica else 0
        moved += leaving * state.context * shape.kv_bytes_per_token(dtype)  # (all layers)
    return moved / link_Bps + t_iter


def _choices(shape, hw, state: JobState, world: int, pins: Pins, dtype: str):
    wl = Workload(max(1, int(state.context)), max(1, int(state.output_left)))
    job = JobLoad(max(1, state.requests), state.max_seqs_per_replica, wl)
    return plan_world(shape, hw, job, world, pins, dtype)


def decide(meas: Measurements, state: JobState, shape: ModelShape, hw: HardwareProfile,
           world: int, current: tuple, micro_batches: int, min_gain: float,
           link_gbps: float = 10.0, dtype: str = "float32", vary_m: bool = False) -> Decision:
    """Switch to the planner's best split of ``world`` when it wins by more than ``min_gain``;
    ``vary_m``: the best plan may have another micro-batch count (else it is held)."""
    m0 = micro_batches

    def stay(why: str, t: float = float("nan")) -> Decision:
        return Decision(False, current, current, t, t, 0.0, 0.0, why, (m0, m0))
    if state.requests < 1 or state.output_left < 1:
        return stay("no work left")
    try:
        hw_m = measured_hardware(hw, shape, meas, dtype)
    except ConfigError as e:
        return stay(f"cannot refit: {e}")
    try:
        ranked = _choices(shape, hw_m, state, world, Pins(attention_tp=1, micro_batches=None
                                                          if vary_m else m0), dtype)
        now = _choices(shape, hw_m, state, world, Pins(attention_tp=1, micro_batches=m0,
                                                       attention_replicas=current[0],
                                                       expert_ranks=current[1]), dtype)[0]
    except NoWorldPlanError as e:
        return stay(f"planner: {e}")
    tokens = state.requests * state.output_left
    t_now = tokens / now.pred.tokens_per_s
    best = ranked[0]
    target, ms = (best.plan.n_a, best.plan.n_e), (m0, best.plan.m)
    t_best = tokens / best.pred.tokens_per_s
    if target == tuple(current) and ms[1] == m0:
        return Decision(False, current, target, t_now, t_best, 0.0, 0.0, "current plan is best",
                        ms)
    # the split's cost (weights, KV, a drained iteration); the micro-batch count alone: a drain
    cost = switch_cost(shape, tuple(current), target, state, now.pred.t_iter,
                       link_gbps * 1e9 / 8, dtype) if target != tuple(current) else now.pred.t_iter
    gain = (t_now - t_best - cost) / t_now
    ok = gain > min_gain
    why = (f"gain above min_gain {min_gain:.2f}" if ok else
           f"gain below min_gain {min_gain:.2f}")
    return Decision(ok, tuple(current), target, t_now, t_best, cost, gain, why, ms)

