"""Discrete-event simulator of the ping-pong pipeline (docs/design_rules.md) for any n_a x n_e.

Every lane (attention, A2E, expert, E2A of every rank) is a FIFO server that serves
(layer, micro-batch) in the same fixed order as the runtime, so each event's start is
max(lane free, inputs arrived): processing items in that order is an exact event-driven
simulation without a priority queue. Per-message latency jitter (exponential, mean jitter_s)
and per-expert load from a routing distribution make the lanes wait on the slowest sender.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from megainfer.config import ConfigError
from megainfer.perfmodel.trace import A2E, ATTENTION, E2A, EXPERT, TraceWriter


@dataclass(frozen=True)
class SimConfig:
    n_a: int  # attention replicas
    n_e: int  # expert ranks (each holds num_experts / n_e experts)
    m: int
    layers: int
    b_a: int  # tokens per micro-batch per attention replica
    num_experts: int
    top_k: int
    tp_a: int = 1
    tp_e: int = 1
    jitter_s: float = 0.0
    routing: str = "balanced"  # balanced | zipf
    skew: float = 1.0  # zipf exponent for routing=zipf
    iterations: int = 1
    seed: int = 0

    def __post_init__(self):
        for n in ("n_a", "n_e", "m", "layers", "num_experts", "top_k", "tp_a", "tp_e", "iterations"):
            v = getattr(self, n)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"sim.{n}={v!r}: must be an integer >= 1")
        if self.num_experts % self.n_e:
            raise ConfigError(f"sim.n_e={self.n_e}: must divide num_experts={self.num_experts}")
        if self.routing not in ("balanced", "zipf"):
            raise ConfigError(f"sim.routing={self.routing!r}: must be balanced or zipf")
        if self.jitter_s < 0 or self.b_a < 0:
            raise ConfigError(f"sim.jitter_s={self.jitter_s}, b_a={self.b_a}: must be >= 0")


@dataclass
class SimResult:
    iteration_s: list  # wall time of each iteration
    trace: Optional[TraceWriter] = None
    expert_busy: list = field(default_factory=list)  # per expert rank, seconds computing

    @property
    def mean_iteration_s(self) -> float:
        return float(np.mean(self.iteration_s))


def _routing(cfg: SimConfig, rng: np.random.Generator) -> Callable[[], np.ndarray]:
    """Returns draw() -> token counts per expert [m, E] for one layer."""
    slots = cfg.b_a * cfg.n_a * cfg.top_k
    if cfg.routing == "balanced":
        even = np.full((cfg.m, cfg.num_experts), slots / cfg.num_experts)
        return lambda: even
    p = 1.0 / np.arange(1, cfg.num_experts + 1) ** cfg.skew

    def draw():
        perm = rng.permutation(cfg.num_experts)  # which experts are hot changes per layer
        q = (p / p.sum())[perm]
        return rng.multinomial(slots, q, size=cfg.m).astype(float)
    return draw


def simulate(cfg: SimConfig, t_attn: Callable[[float], float],
             t_expert: Callable[[np.ndarray], float], t_comm: float,
             trace: bool = True) -> SimResult:
    """t_attn(b_a) and t_expert(counts of one rank's experts) in seconds; t_comm one-way seconds."""
    rng = np.random.default_rng(cfg.seed)
    draw = _routing(cfg, rng)
    el = cfg.num_experts // cfg.n_e
    tw = TraceWriter() if trace else None
    pid_e0 = cfg.n_a * cfg.tp_a
    if tw:
        tw.name_ranks(cfg.n_a, cfg.tp_a, cfg.n_e, cfg.tp_e)

    def jit(n):
        return rng.exponential(cfg.jitter_s, n) if cfg.jitter_s > 0 else np.zeros(n)

    def emit(pids, cat, s, e, it, l, i, tok):
        if tw:
            for p in pids:
                tw.span(p, cat, s, e, it, l, i, tok)

    ta = t_attn(cfg.b_a)
    busy = np.zeros(cfg.n_e)
    t0, iters = 0.0, []
    for it in range(cfg.iterations):
        ready = np.full((cfg.n_a, cfg.m), t0)  # E2A of (mb, previous layer) arrived at replica
        attn_free, a2e_free = np.full(cfg.n_a, t0), np.full(cfg.n_a, t0)
        exp_free, e2a_free = np.full(cfg.n_e, t0), np.full(cfg.n_e, t0)
        for l in range(cfg.layers):
            counts = draw()  # [m, E]
            for i in range(cfg.m):
                arr = np.empty((cfg.n_a, cfg.n_e))  # A2E arrival at expert r from replica a
                for a in range(cfg.n_a):
                    s = max(attn_free[a], ready[a, i])
                    attn_free[a] = s + ta
                    s2 = max(a2e_free[a], s + ta)
                    a2e_free[a] = s2 + t_comm
                    arr[a] = s2 + t_comm + jit(cfg.n_e)
                    pids = range(a * cfg.tp_a, (a + 1) * cfg.tp_a)
                    emit(pids, ATTENTION, s, s + ta, it, l, i, cfg.b_a)
                    emit(pids, A2E, s2, arr[a].max(), it, l, i, cfg.b_a * cfg.top_k)
                back = np.empty((cfg.n_e, cfg.n_a))  # E2A arrival at replica a from expert r
                for r in range(cfg.n_e):
                    c = counts[i, r * el:(r + 1) * el]
                    te = t_expert(c)
                    busy[r] += te
                    s = max(exp_free[r], arr[:, r].max())
                    exp_free[r] = s + te
                    s2 = max(e2a_free[r], s + te)
                    e2a_free[r] = s2 + t_comm
                    back[r] = s2 + t_comm + jit(cfg.n_a)
                    pids = range(pid_e0 + r * cfg.tp_e, pid_e0 + (r + 1) * cfg.tp_e)
                    emit(pids, EXPERT, s, s + te, it, l, i, c.sum())
                    emit(pids, E2A, s2, back[r].max(), it, l, i, c.sum())
                ready[:, i] = back.max(axis=0)
        t1 = float(ready.max())
        iters.append(t1 - t0)
        t0 = t1
    return SimResult(iters, tw, busy.tolist())


def simulate_plan(model, plan, jitter_s: float = 0.0, routing: str = "balanced", skew: float = 1.0,
                  iterations: int = 1, seed: int = 0, trace: bool = True) -> SimResult:
    """Simulate a perfmodel Plan with the model's T_a, T_e, T_c (DisaggModel)."""
    s = model.shape
    if plan.batch % (plan.m * plan.n_a):
        raise ConfigError(f"plan.batch={plan.batch}: must be a multiple of m*n_a={plan.m * plan.n_a}")
    b_a = plan.batch // (plan.m * plan.n_a)
    cfg = SimConfig(n_a=plan.n_a, n_e=plan.n_e, m=plan.m, layers=s.num_layers, b_a=b_a,
                    num_experts=s.num_experts, top_k=s.top_k, tp_a=plan.tp_a, tp_e=plan.tp_e,
                    jitter_s=jitter_s, routing=routing, skew=skew, iterations=iterations, seed=seed)
    t_attn, t_expert, t_comm = model.stage_fns(plan)  # kernel fits + node sharing terms
    res = simulate(cfg, t_attn, t_expert, t_comm, trace=trace)
    return res
