"""Whole jobs on the colocated baseline (``model.colocated.ColocatedModel`` + ``ColocatedPlan``).

The same job loop as ``job.simulate_job`` (the group is one replica), each iteration timed per
(layer, micro-batch) like ``ColocatedModel.predict`` but from the micro-batch's own tokens and
context: attention over the group's TP, dispatch / combine all-to-alls timed by the device
receiving the most token slots, experts by the slowest device; m = 1 in sequence, m = 2 (DBO)
max(sum of compute, sum of communication, max over micro-batches of compute + communication).
Invariant: a fixed balanced batch reproduces ``ColocatedModel.predict(plan).t_iter``.
docs/perfmodel.md, "The whole-job simulator".
"""
from __future__ import annotations

import numpy as np

from megainfer.perfmodel.model.colocated import ColocatedModel, ColocatedPlan
from megainfer.perfmodel.sim.events import Requests
from megainfer.perfmodel.sim.job import JobConfig, expert_times, run_scheduler
from megainfer.perfmodel.sim.job_result import JobResult


class ColocatedPipeline:
    def __init__(self, model: ColocatedModel, plan: ColocatedPlan):
        self.model, self.plan = model, plan
        self.e_local, self.tp_e = model.expert_split(plan.group)
        node, g = model.hw.node, plan.group
        self.h_a, self.d_a = node.hop_overhead("attention", g), node.dilation("attention", g)
        self.h_e, self.d_e = node.hop_overhead("expert", g), node.dilation("expert", g)
        self.wake = node.wake_latency_s
        self.slot_bytes = model.shape.hidden_size * model.act_b

    def t_x(self, slots: float) -> float:
        """One all-to-all, the busiest device receiving ``slots`` token slots."""
        g = self.plan.group
        if g <= 1 or slots <= 0:
            return 0.0
        return self.model.hw.intra_link.time(slots * self.slot_bytes, n_msgs=g - 1) + self.wake

    def iteration(self, t0: float, tok: np.ndarray, ctx: np.ndarray, rows: np.ndarray,
                  counts: np.ndarray, trace=None, it: int = 0) -> float:
        """End time of one iteration; tok, ctx, rows: [1, m]; counts: [layers, m, E]."""
        g, L, m = self.plan.group, counts.shape[0], counts.shape[1]
        mdl, s = self.model, self.model.shape
        act = [i for i in range(m) if tok[0, i] > 0]
        t_a = {i: (mdl.t.t_attn(tok[0, i], ctx[0, i], g) + self.h_a) * self.d_a for i in act}
        if self.tp_e == 1:  # EP: device d holds experts [d * e_local, (d + 1) * e_local)
            per_dev = counts.reshape(L, m, g, self.e_local)
        else:  # expert TP: tp_e devices share each expert (one expert per device group)
            per_dev = counts.reshape(L, m, s.num_experts, 1)
        te = expert_times(mdl.t, per_dev, self.tp_e)
        te = np.where(te > 0, (te + self.h_e) * self.d_e, 0.0).max(axis=-1)  # [L, m]
        slots = per_dev.sum(axis=-1).max(axis=-1) / self.tp_e  # [L, m] busiest device's slots
        t = t0
        for l in range(L):
            comp = {i: t_a[i] + te[l, i] for i in act}
            comm = {i: 2 * self.t_x(slots[l, i]) for i in act}
            if self.plan.m == 1 or len(act) == 1:
                t += sum(comp[i] + comm[i] for i in act)
            else:
                t += max(sum(comp.values()), sum(comm.values()), max(comp[i] + comm[i] for i in act))
        return t + sum(mdl.t.t_head(rows[0, i], g) for i in act)


def simulate_colocated_job(model: ColocatedModel, plan: ColocatedPlan, requests: Requests,
                           cfg: JobConfig = JobConfig()) -> JobResult:
    """Run ``requests`` to completion on one colocated group (``cfg.trace_iterations`` ignored)."""
    return run_scheduler(ColocatedPipeline(model, plan), 1, plan.m, model.shape, requests, cfg)
