"""The parts of ``pd.simulate_pd_job`` that price work: a prefill replica's step times
(``Prefill``), a step in flight (``PrefillStep``) and the node's cores shared between prefill
and decode ranks (``Node``, docs/perfmodel.md "PD as one simulation")."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import DisaggModel, Plan
from megainfer.perfmodel.sim.events import draw_counts
from megainfer.perfmodel.sim.job import Pipeline, expert_times


class Prefill:
    """Step times of one prefill replica of ``pool``."""

    def __init__(self, pool, probs, rng):
        self.pool, self.probs, self.rng = pool, probs, rng
        s = pool.shape
        self.L, self.K, self.E = s.num_layers, s.top_k, s.num_experts

    def step_s(self, n: int, ctx: float, rows: int, seqs: int = 1) -> tuple[float, float]:
        """(attention + lm_head + per-prompt host work, experts) seconds of one step of ``n``
        tokens of ``seqs`` prompts, alone on its cores (``PrefillPool.prompt_host_s``)."""
        t, tp = self.pool.t, self.pool.tp_p
        counts = draw_counts(self.probs, np.array([n]), self.K, self.E, self.L, self.rng)[:, 0, :]
        te = float(expert_times(t, counts, tp).sum())
        host = self.L * seqs * self.pool.prompt_host_s
        return self.L * t.t_attn(n, ctx, tp) + (t.t_head(rows, tp) if rows else 0.0) + host, te


@dataclass
class PrefillStep:
    """A prefill replica's step in flight: it ends at ``end`` if its ``rate`` (alone-seconds of
    work per second, below 1 while it shares cores) holds; ``left`` alone-seconds remain as of
    ``since``. ``row``: its entry of the result's prefill steps (duration set at the end)."""

    end: float
    start: float
    work: list  # [(request, prompt tokens)]
    attn_s: float
    exp_s: float
    row: list
    left: float
    rate: float
    since: float


class Node:
    """Core sharing between the prefill replicas and the decode pool (the node terms of
    docs/perfmodel.md, "Ranks sharing a node"). Prefill and decode ranks share a node when they
    run on the same hardware profile (``plan.ranks_per_node`` < all ranks: that share of each
    role's ranks on a node). A prefill step is stretched by ``NodeProfile.dilation`` of the ranks
    computing beside it: its own TP group and the other busy prefill replicas, and, while a
    decode iteration is in flight, the decode side's ranks for the fraction of the iteration
    each side computes (u = m L T_side / T_total at the plan's balanced load; with m = 1 the
    two sides alternate, with m >= 2 they overlap independently). A decode iteration sees the
    prefill ranks busy at its start as extra ranks on its node (``Pipeline(others_busy=)``).
    ``idle_decode_busy``: the share of a core each decode rank (attention and expert) takes while
    the pool has nothing to decode (the CPU runtime keeps its lock-step pipeline stepping with
    empty batches and its ranks poll: perf/bench_pd.py measured 0.15-0.4 CPU-s per second); a
    prefill step then time-shares the cores with that demand (u x the decode ranks on its node,
    added to the ranks computing beside it). GPU profiles (node.cores = 0) share nothing."""

    def __init__(self, pool, model: DisaggModel, plan: Plan, idle_decode_busy: float = 0.0):
        if not (0.0 <= idle_decode_busy <= 1.0):
            raise ConfigError(f"idle_decode_busy={idle_decode_busy!r}: must be in [0, 1]")
        self.node = nd = pool.hw.node
        self.model, self.plan = model, plan
        tot = pool.devices + plan.devices
        share = min(1.0, plan.ranks_per_node / tot) if plan.ranks_per_node else 1.0
        self.tp = pool.tp_p * share
        same_a, same_e = pool.hw.name == model.hw_a.name, pool.hw.name == model.hw_e.name
        self.shared = nd.shared and (same_a or same_e)
        self.states = [(1.0, 0.0)]  # (probability, decode ranks computing) while decode runs
        ranks_a = plan.n_a * plan.tp_a if same_a else 0  # decode ranks on the prefill node's kind
        ranks_e = plan.n_e * plan.tp_e if same_e else 0
        # the decode ranks' demand while nothing decodes
        self.idle = [(1.0, idle_decode_busy * ((ranks_a + ranks_e) * share))]
        if self.shared and plan.batch > 0:
            pr = model.predict(plan)
            L = model.shape.num_layers
            u_a = min(1.0, plan.m * L * pr.t_a / pr.t_total) if pr.t_total > 0 else 0.0
            u_e = min(1.0, plan.m * L * pr.t_e / pr.t_total) if pr.t_total > 0 else 0.0
            r_a, r_e = ranks_a * share, ranks_e * share
            if plan.m == 1:
                u_e = min(u_e, 1.0 - u_a)
                self.states = [(1.0 - u_a - u_e, 0.0), (u_a, r_a), (u_e, r_e)]
            else:
                self.states = [((1 - u_a) * (1 - u_e), 0.0), (u_a * (1 - u_e), r_a),
                               ((1 - u_a) * u_e, r_e), (u_a * u_e, r_a + r_e)]
        self.pipes: dict = {}

    def rate(self, attn_s: float, exp_s: float, prefill_busy: int, decoding: bool) -> float:
        """Progress per second of a step with these alone-times (1: no sharing)."""
        if not self.shared or attn_s + exp_s <= 0:
            return 1.0
        own = self.tp * prefill_busy
        states = self.states if decoding else self.idle
        d_a = sum(p * self.node.dilation("attention", own + r) for p, r in states)
        d_e = sum(p * self.node.dilation("expert", own + r) for p, r in states)
        return (attn_s + exp_s) / (attn_s * d_a + exp_s * d_e)

    def pipeline(self, prefill_busy: int) -> Pipeline:
        """The decode pool's pipeline with ``prefill_busy`` prefill replicas computing beside it."""
        x = self.tp * prefill_busy if self.shared else 0.0
        if x not in self.pipes:
            self.pipes[x] = Pipeline(self.model, self.plan, others_busy=x)
        return self.pipes[x]
