"""Event-driven simulator of whole jobs on a disaggregated plan (``DisaggModel`` + ``Plan``).

Unlike ``fixed_batch.py`` (one fixed batch), this runs a job: requests arrive, each attention
replica's scheduler does continuous batching with chunked prefill as
``megainfer/engine/scheduler.py`` does, replicas step in lock step, and each iteration goes
through the ping-pong pipeline event by event: attention T_a per (layer, micro-batch), experts
by a ``Routing`` draw (the slowest rank sets the layer), A2E / E2A over links of finite
bandwidth, FIFO across steps. The per-(layer, micro-batch) recursion is vectorised over ranks.
Invariant: a fixed batch with balanced routing reproduces ``DisaggModel.predict`` (t_iter).
docs/perfmodel.md, "The whole-job simulator".
"""
from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import DisaggModel, Plan
from megainfer.perfmodel.model.hardware import with_background_load
from megainfer.perfmodel.model.layer_times import FittedTimes
from megainfer.perfmodel.sim.events import Requests, Routing, draw_counts, makespan_outer
from megainfer.perfmodel.sim.job_result import JobResult
from megainfer.perfmodel.trace import A2E, ATTENTION, E2A, EXPERT, TraceWriter


@dataclass(frozen=True)
class JobConfig:
    max_num_seqs: int = 64  # per attention replica, as scheduler.max_num_seqs
    max_num_batched_tokens: int = 512  # per replica and iteration, as the scheduler's budget
    routing: Routing = field(default_factory=Routing)
    seed: int = 0
    max_iterations: int = 1_000_000
    trace_iterations: int = 0  # spans of the first N iterations into JobResult.trace
    iteration_overhead_s: float = 0.0  # host work per iteration (sampling, scheduling, inputs)

    def __post_init__(self):
        if not (self.iteration_overhead_s >= 0 and np.isfinite(self.iteration_overhead_s)):
            raise ConfigError(f"job.iteration_overhead_s={self.iteration_overhead_s!r}: must be >= 0")
        for n in ("max_num_seqs", "max_num_batched_tokens", "max_iterations"):
            v = getattr(self, n)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"job.{n}={v!r}: must be an integer >= 1")


def _util(link, nbytes: np.ndarray) -> np.ndarray:
    """LinkProfile.utilisation, vectorised (log-size interpolation, clamped; <= 0 bytes: 1)."""
    nbytes = np.asarray(nbytes, float)
    if not link.curve:
        return np.ones_like(nbytes)
    xs = np.log([s for s, _ in link.curve])
    us = np.array([u for _, u in link.curve])
    u = np.interp(np.log(np.maximum(nbytes, 1e-300)), xs, us)
    return np.where(nbytes > 0, u, 1.0)


def _allreduce(hw, nbytes: np.ndarray, tp: int) -> np.ndarray:
    if tp <= 1:
        return np.zeros_like(nbytes)
    lk = hw.intra_link
    moved = 2.0 * (tp - 1) / tp * nbytes
    t = 2 * (tp - 1) * lk.latency_s + moved / (lk.bandwidth_Bps * _util(lk, nbytes / tp))
    return np.where(nbytes > 0, t, 0.0)


def expert_times(times, counts: np.ndarray, tp: int) -> np.ndarray:
    """``times.t_expert`` over the last axis of ``counts`` (one rank's experts), vectorised."""
    s, act = times.shape, counts > 0
    tokens = np.where(act, counts, 0.0).sum(axis=-1)
    ar = _allreduce(times.hw, tokens * s.hidden_size * times.wb, tp)
    if isinstance(times, FittedTimes):
        f = times.fit
        return (f.k4 * act.sum(axis=-1) + f.k3 * tokens / tp) + ar
    flops = 2 * tokens * s.expert_params * times.qflop_scale / tp
    nbytes = act.sum(axis=-1) * s.expert_bytes(times.dtype) / tp
    nbytes = nbytes + tokens * (2 * s.hidden_size + 2 * s.moe_intermediate_size / tp) * times.wb
    t = np.maximum(flops / times.flops, nbytes / times.bw) + times.hw.kernel_overhead_s + ar
    return np.where(act.any(axis=-1), t, 0.0)


class Pipeline:
    """One plan's stage times and links; ``iteration`` runs one step's pipeline from t0."""

    def __init__(self, model: DisaggModel, plan: Plan, others_busy: float = 0.0):
        """``others_busy``: ranks of other roles on the decode ranks' node (PD's prefill ranks)
        computing through this plan's iterations: they time-share its cores (node terms)."""
        self.model, self.plan, s = model, plan, model.shape
        self.el = model.experts_per_rank(plan.n_e)
        self.node_model = _with_others(model, others_busy)
        self.h_a, self.h_e, self.d_a, self.d_e = self.node_model.plan_node_terms(plan)
        self.la, self.le = model.hw_a.inter_link, model.hw_e.inter_link
        self.wake = max(model.hw_a.node.wake_latency_s, model.hw_e.node.wake_latency_s)
        self.tok_bytes = s.hidden_size * model.act_b

    def node_terms(self, ta0: np.ndarray, te0: np.ndarray) -> tuple[float, float, float, float]:
        """(h_a, h_e, d_a, d_e) of one iteration: ``DisaggModel.node_terms`` at this iteration's
        mean compute per (replica, micro-batch) ``ta0`` and per (layer, micro-batch, expert rank)
        ``te0`` (alone-CPU seconds, zeros skipped), so a prefill chunk's long attention and a
        decode step's short one share the node's cores differently. A fixed balanced batch gets
        the plan's terms (``plan_node_terms``)."""
        a, e = ta0[ta0 > 0], te0[te0 > 0]
        if not len(a) or not len(e):
            return self.h_a, self.h_e, self.d_a, self.d_e
        return self.node_model.node_terms(self.plan, float(a.mean()), float(e.mean()))

    def _emit(self, tw, it, l, i, tok, s, ta, s2, a2e_end, s3, e_end, s4, e2a_end, etok):
        p, k = self.plan, self.model.shape.top_k
        for a in range(p.n_a):
            for q in range(a * p.tp_a, (a + 1) * p.tp_a):
                tw.span(q, ATTENTION, float(s[a]), float(s[a] + ta[a]), it, l, i, float(tok[a]))
                tw.span(q, A2E, float(s2[a]), float(a2e_end), it, l, i, float(tok[a] * k))
        for r in range(p.n_e):
            for q in range(p.n_a * p.tp_a + r * p.tp_e, p.n_a * p.tp_a + (r + 1) * p.tp_e):
                tw.span(q, EXPERT, float(s3[r]), float(e_end[r]), it, l, i, float(etok[r]))
                tw.span(q, E2A, float(s4[r]), float(e2a_end), it, l, i, float(etok[r]))

    def iteration(self, t0: float, tok: np.ndarray, ctx: np.ndarray, rows: np.ndarray,
                  counts: np.ndarray, trace: TraceWriter | None = None, it: int = 0,
                  ingress_free: np.ndarray | None = None, remote_s: np.ndarray | None = None) -> float:
        """End time of one iteration. tok, ctx, rows: [n_a, m] tokens, mean context and sampled
        rows per (replica, micro-batch); counts: [layers, m, E] tokens per expert;
        ingress_free: [n_a] when each replica's ingress link is free of other traffic (PD's KV
        transfers, ``sim.pd``), so its E2A messages queue behind it; remote_s: [n_a, m] seconds
        per layer of the offloaded rows' attention (round trip to the prefill replicas and their
        attention there, ``sim.pd_offload``): it overlaps the local attention, so the attention
        part of a (layer, micro-batch) is the longer of the two."""
        p, L = self.plan, counts.shape[0]
        n_a, n_e, tp_a, tp_e = p.n_a, p.n_e, p.tp_a, p.tp_e
        act = np.flatnonzero(tok.sum(axis=0) > 0)  # empty micro-batches are skipped
        ta = np.array([[self.model.ta.t_attn(b, c, tp_a) if b > 0 else 0.0 for b, c in zip(rb, rc)]
                       for rb, rc in zip(tok, ctx)])  # [n_a, m] alone
        head = np.array([sum(self.model.ta.t_head(r, tp_a) for r in rr) for rr in rows])
        cr = counts.reshape(L, counts.shape[1], n_e, self.el)
        te = expert_times(self.model.te, cr, tp_e)  # [L, m, n_e] alone
        h_a, h_e, d_a, d_e = self.node_terms(ta, te)
        ta = np.where(tok > 0, (ta + h_a) * d_a, 0.0)
        if remote_s is not None:
            ta = np.where(tok > 0, np.maximum(ta, remote_s), 0.0)
        te = np.where(te > 0, (te + h_e) * d_e, 0.0)
        sent = tok * self.model.shape.top_k * self.tok_bytes  # [n_a, m] bytes a replica sends
        recv = cr.sum(axis=-1) * self.tok_bytes  # [L, m, n_e] bytes each expert rank receives
        frac = tok / np.maximum(tok.sum(axis=0), 1e-300)  # [n_a, m] replica's share of a micro-batch
        u_sa = _util(self.la, sent / tp_a / n_e)  # [n_a, m]
        u_re = _util(self.le, recv / tp_e / n_a)  # [L, m, n_e]
        rate_a, rate_e = self.la.bandwidth_Bps * u_sa, self.le.bandwidth_Bps * u_re
        snd_a = self.la.latency_s + sent / tp_a / rate_a  # replica's NIC time for its messages
        snd_e = self.le.latency_s + recv / tp_e / rate_e  # expert rank's NIC time (E2A)
        w_e = recv / tp_e / rate_e  # s per unit share of replica traffic on expert rank's ingress
        w_a = frac / tp_a / rate_a  # s per byte of expert traffic on replica's ingress  [n_a, m]
        ready = np.full((n_a, counts.shape[1]), t0)
        attn_free = np.full(n_a, t0)
        in_a = np.full(n_a, t0) if ingress_free is None else np.maximum(ingress_free, t0)
        exp_free, in_e = np.full(n_e, t0), np.full(n_e, t0)
        a2e_free = e2a_free = t0  # each side's NICs send a step's messages together: one lane
        lat_a, lat_e, wake = self.la.latency_s, self.le.latency_s, self.wake
        for l in range(L):
            for i in act:
                s = np.maximum(attn_free, ready[:, i])
                attn_free = s + ta[:, i]
                s2 = np.maximum(a2e_free, attn_free)  # A2E: replica a's messages leave
                in_e = makespan_outer(s2, frac[:, i], in_e, w_e[l, i]) + lat_e
                arr = np.maximum((s2 + snd_a[:, i]).max(), in_e) + wake  # [n_e] all arrived
                a2e_free = arr.max()
                s3 = np.maximum(exp_free, arr)
                exp_free = s3 + te[l, i]
                s4 = np.maximum(e2a_free, exp_free)  # E2A: expert rank r's replies leave
                in_a = makespan_outer(s4, recv[l, i], in_a, w_a[:, i]) + lat_a
                back = np.maximum((s4 + snd_e[l, i]).max(), in_a) + wake  # [n_a]
                e2a_free = back.max()
                ready[:, i] = back
                if trace is not None:
                    self._emit(trace, it, l, int(i), tok[:, i], s, ta[:, i], s2, arr.max(), s3,
                               exp_free, s4, back.max(), cr[l, i].sum(axis=-1))
        ends = ready[:, act].max(axis=1) + head if len(act) else np.full(n_a, t0)
        return float(ends.max())


def _with_others(model: DisaggModel, busy: float) -> DisaggModel:
    """``model`` whose nodes also run ``busy`` more computing ranks (as background load)."""
    if busy <= 0 or not (model.hw_a.node.shared or model.hw_e.node.shared):
        return model
    m = copy.copy(model)
    m.hw_a = with_background_load(model.hw_a, model.hw_a.node.background_load + busy)
    m.hw_e = with_background_load(model.hw_e, model.hw_e.node.background_load + busy)
    return m


def _split(n: np.ndarray, m: int) -> np.ndarray:
    """Micro-batch of each scheduled sequence (runtime/pipeline/microbatch.split_by_tokens)."""
    tot = n.sum()
    if tot == 0:
        return np.zeros(len(n), dtype=np.int64)
    mid = np.cumsum(n) - n / 2
    return np.minimum(m - 1, np.floor(mid * m / tot)).astype(np.int64)


def simulate_job(model: DisaggModel, plan: Plan, requests: Requests,
                 cfg: JobConfig = JobConfig()) -> JobResult:
    """Run ``requests`` to completion on ``plan``; request k goes to replica k mod n_a."""
    tw = TraceWriter() if cfg.trace_iterations else None
    if tw:
        tw.name_ranks(plan.n_a, plan.tp_a, plan.n_e, plan.tp_e)
    return run_scheduler(Pipeline(model, plan), plan.n_a, plan.m, model.shape, requests, cfg, tw)


def run_scheduler(pipe, n_a: int, m: int, s, requests: Requests, cfg: JobConfig,
                  tw: TraceWriter | None = None) -> JobResult:
    """The job loop shared by every layout: per-replica continuous batching (see the module
    docstring), each iteration timed by ``pipe.iteration(t0, tok, ctx, rows, counts, trace, it)``
    with tok / ctx / rows [n_a, m] and counts [layers, m, E] (``s``: the ModelShape)."""
    rng = np.random.default_rng(cfg.seed)
    probs = cfg.routing.probabilities(s.num_layers, s.num_experts, rng)
    n = len(requests)
    P, O = requests.prompt_len, requests.output_len
    computed, gen = np.zeros(n, np.int64), np.zeros(n, np.int64)
    first, fin = np.full(n, np.nan), np.full(n, np.nan)
    waiting = [deque() for _ in range(n_a)]
    running = [[] for _ in range(n_a)]
    t, nxt, iters, left = 0.0, 0, [], n
    for _ in range(cfg.max_iterations):
        if left == 0:
            break
        if not any(waiting) and not any(running):
            t = max(t, float(requests.arrival_s[nxt]))
        while nxt < n and requests.arrival_s[nxt] <= t:
            waiting[nxt % n_a].append(nxt)
            nxt += 1
        tok, ctxs, rows = np.zeros((n_a, m)), np.zeros((n_a, m)), np.zeros((n_a, m))
        sched = []
        for a in range(n_a):
            run = np.array(running[a], np.int64)
            need = P[run] + gen[run] - computed[run]
            before = np.concatenate([[0], np.cumsum(need)[:-1]])
            take = np.clip(cfg.max_num_batched_tokens - before, 0, need)
            budget = cfg.max_num_batched_tokens - int(take.sum())
            ids, ns = list(run[take > 0]), list(take[take > 0])
            w, seats = waiting[a], len(running[a])
            while w and budget > 0 and seats < cfg.max_num_seqs:
                k = w.popleft()
                x = min(int(P[k] - computed[k]), budget)
                running[a].append(k)
                ids.append(k), ns.append(x)
                budget -= x
                seats += 1
            ids, ns = np.array(ids, np.int64), np.array(ns, np.int64)
            if len(ids):
                mb = _split(ns, m)
                c0 = computed[ids]
                tok[a] = np.bincount(mb, ns, m)
                ctxs[a] = np.bincount(mb, ns * (c0 + (ns + 1) / 2), m)
                rows[a] = np.bincount(mb, ((c0 + ns) >= P[ids] + gen[ids]).astype(float), m)
            sched.append((ids, ns))
        if tok.sum() == 0:  # nobody runnable (cannot happen with budget >= 1): wait for arrivals
            if nxt >= n:
                break
            t = float(requests.arrival_s[nxt])
            continue
        ctx = np.divide(ctxs, tok, out=np.zeros_like(ctxs), where=tok > 0)
        counts = draw_counts(probs, tok.sum(axis=0), s.top_k, s.num_experts, s.num_layers, rng)
        ik = len(iters)
        t_end = pipe.iteration(t, tok, ctx, rows, counts, tw if ik < cfg.trace_iterations else None, ik)
        t_end += cfg.iteration_overhead_s
        iters.append((t, t_end - t, float(tok.sum())))
        t = t_end
        for a, (ids, ns) in enumerate(sched):
            if not len(ids):
                continue
            computed[ids] += ns
            samp = ids[computed[ids] >= P[ids] + gen[ids]]
            gen[samp] += 1
            first[samp[gen[samp] == 1]] = t
            done = samp[gen[samp] >= O[samp]]
            fin[done] = t
            left -= len(done)
            if len(done):
                dset = set(done.tolist())
                running[a] = [k for k in running[a] if k not in dset]
    return JobResult(requests.arrival_s, first, fin, O, iters, tw)
