"""One event loop for a prefill/decode (PD) split: prefill replicas, KV transfers, decode pool.

What ``runtime/pd/router.py``, ``runtime/pd/prefill_worker.py`` and ``runtime/pd/decode.py`` do,
as a discrete-event simulation over one clock: FCFS admission by rank 0, each prefill replica's
chunked-prefill scheduler (``PrefillPool``), KV streamed layer by layer over the prefill egress
and decode ingress (FIFO), and the decode pool as ``sim.job.Pipeline.iteration`` in lock step.
Invariants: events are applied before anything starts at the same time, so what is ready at t
is seen by what starts at t; a request decodes from the first iteration after its first token
and its whole KV arrived. Shared cores are time-shared (``pd_parts.Node``), rates recomputed at
every event. ``offload`` (``sim.pd_offload``): some requests keep their KV on their prefill
replica, which runs their decode attention every layer (docs/pd.md ``pd.offload``), until one
the policy would offload finds the pool short and sends them home (their KV moved to the decode
replica before its next iteration, which waits for it).
docs/perfmodel.md, "PD as one simulation" and "The offload in the PD simulator".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import DisaggModel, Plan
from megainfer.perfmodel.sim.events import Requests, draw_counts
from megainfer.perfmodel.sim.job import JobConfig, _split
from megainfer.perfmodel.sim.job_result import JobResult
from megainfer.perfmodel.sim.pd_offload import Offload, OffloadBook, RemoteAttention, kv_link
from megainfer.perfmodel.sim.pd_parts import Node, Prefill, PrefillStep


@dataclass
class PdJobResult(JobResult):
    """JobResult (decode iterations in ``iteration_s``) plus the prefill side."""

    prefill_steps: list = field(default_factory=list)  # (replica, start, duration, tokens)
    kv_ready_s: np.ndarray | None = None  # when each request's whole KV had arrived
    offloaded: np.ndarray | None = None  # [requests] bool: its decode attention ran on its prefill replica
    returned_home: np.ndarray | None = None  # [requests] bool: offloaded, then its KV went home
    # per decode iteration and (replica, micro-batch) with offloaded rows: one layer's round trip, s
    round_trip_s: np.ndarray | None = None

    @property
    def handoff_s(self) -> np.ndarray:
        """First token to KV arrived (0 when the transfer was hidden behind prefill)."""
        return np.maximum(self.kv_ready_s - self.first_token_s, 0.0)


def simulate_pd_job(pool, model: DisaggModel, plan: Plan, requests: Requests,
                    cfg: JobConfig = JobConfig(), dtype: str = "bfloat16",
                    prefill_tokens: int | None = None, idle_decode_busy: float = 0.0,
                    offload: Offload = Offload(), decode_kv_tokens: int | None = None) -> PdJobResult:
    """Run ``requests`` through ``pool`` (``model.prefill_pool.PrefillPool``) and the decode ``plan``;
    ``idle_decode_busy``: the share of a core each decode rank takes while the pool has nothing
    to decode (``pd_parts.Node``; 0: they wait without computing); ``offload``: the decode
    attention offload (ratio 0: off); ``decode_kv_tokens``: a decode replica's KV cache in
    tokens (None: unlimited): a request decoding there holds its prompt + output tokens from
    its first decode step on, and waits (FCFS) until they fit; offloaded requests hold none."""
    rng = np.random.default_rng(cfg.seed)
    s = model.shape
    probs = cfg.routing.probabilities(s.num_layers, s.num_experts, rng)
    pre = Prefill(pool, probs, rng)
    node = Node(pool, model, plan, idle_decode_busy)
    budget = prefill_tokens or cfg.max_num_batched_tokens
    n, n_a, n_p, m = len(requests), plan.n_a, pool.n_p, plan.m
    A, P, O = requests.arrival_s, requests.prompt_len, requests.output_len
    order = np.argsort(A, kind="stable")
    kvb = s.kv_bytes_per_token(dtype)
    bw, lat = kv_link(pool, model, plan.tp_a)
    egress, ingress, msg = np.zeros(n_p), np.zeros(n_a), np.zeros(n_a)
    book, off = OffloadBook(offload, n_p, n_a, decode_kv_tokens), np.zeros(n, bool)
    ever_off, homed, going_home = np.zeros(n, bool), np.zeros(n, bool), []
    remote = RemoteAttention(pool, model, bw, lat, offload)
    life = P + O  # KV tokens of a request's whole life
    kv_used, share = np.zeros(n_a, np.int64), np.ones(n_p)  # share: p's time left to prefill
    computed, gen = np.zeros(n, np.int64), np.zeros(n, np.int64)
    first, fin, ready = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    dec_of, pre_of = np.full(n, -1), np.full(n, -1)
    load, pload = np.zeros(n_a, np.int64), np.zeros(n_p, np.int64)
    pending: list = []  # arrived, not yet handed out (FCFS)
    p_queue = [[] for _ in range(n_p)]  # handed to prefill replica p, prompt unfinished
    p_busy: list = [None] * n_p  # p's PrefillStep in flight
    d_wait = [[] for _ in range(n_a)]  # handed to decode replica a, not yet decoding
    d_run = [[] for _ in range(n_a)]
    d_busy = None  # (end, [(a, ids)]) of the decode iteration in flight
    nxt, left, t, rot_a, rot_p = 0, n, 0.0, 0, 0
    iters, psteps, trips = [], [], []
    for _ in range(cfg.max_iterations * 4):
        if left == 0:
            break
        # 1. what ended at t
        while nxt < n and A[order[nxt]] <= t:
            pending.append(int(order[nxt]))
            nxt += 1
        for b in p_busy:  # a step progresses at its rate since the last event
            if b is not None:
                b.left -= (t - b.since) * b.rate
                b.since = t
        for p in range(n_p):
            if p_busy[p] is not None and p_busy[p].end <= t:
                end, start, work = p_busy[p].end, p_busy[p].start, p_busy[p].work
                p_busy[p].row[2] = end - start  # the step's duration, stretched by sharing
                p_busy[p] = None
                for k, ns in work:
                    computed[k] += ns
                    a = dec_of[k]
                    if off[k]:  # its KV stays: ready one latency after its first token
                        done = end
                    else:
                        nbytes = ns * kvb
                        go = max(start, egress[p], ingress[a])
                        done = max(go + nbytes / bw, end + nbytes / (s.num_layers * bw))
                        egress[p] = ingress[a] = done
                        msg[a] = nbytes / (s.num_layers * bw)  # one layer's message of it
                    if computed[k] >= P[k]:  # prompt done: first token, leave the prefill rank
                        first[k], ready[k] = end, max(end, done + lat)
                        gen[k] = 1
                        p_queue[p].remove(k)
                        pload[p] -= 1
                        if O[k] <= 1:
                            fin[k] = end
                            load[a] -= 1
                            left -= 1
                            book.finished(k)
                        else:
                            d_wait[a].append(k)
        if d_busy is not None and d_busy[0] <= t:
            end, work = d_busy
            d_busy = None
            for a, ids in work:
                computed[ids] += 1
                gen[ids] += 1
                done = ids[gen[ids] >= O[ids]]
                fin[done] = end
                left -= len(done)
                load[a] -= len(done)
                if len(done):
                    dset = set(done.tolist())
                    d_run[a] = [k for k in d_run[a] if k not in dset]
                    if decode_kv_tokens is not None:
                        kv_used[a] -= int(life[done][~off[done]].sum())
                    for k in dset:
                        book.finished(k)
        if left == 0:
            break
        # 2. admission (rank 0): FCFS while a decode replica has room
        while pending:
            room = np.flatnonzero(load < cfg.max_num_seqs)
            if not len(room):
                break
            a = int(room[np.argmin((load[room] * n_a + (room - rot_a) % n_a))])
            q = np.arange(n_p)
            p = int(q[np.argmin(pload * n_p + (q - rot_p) % n_p)])
            rot_a, rot_p = (a + 1) % n_a, (p + 1) % n_p
            k = pending.pop(0)
            dec_of[k], pre_of[k] = a, p
            tpot = None  # auto with a TPOT SLO: the last iteration plus this request's round trips
            if book.auto and offload.tpot_slo_s is not None:
                trip = (remote.one_row_s(float(P[k] + O[k] / 2))
                        + _answer_wait(p_busy[p], offload.layer_wait, s.num_layers))
                tpot = (iters[-1][1] if iters else 0.0) + s.num_layers * trip
            off[k] = ever_off[k] = book.decide(p, a, k, int(life[k]), tpot)
            going_home += book.take_homes()  # their KV moves before the next iteration
            if not off[k] and decode_kv_tokens is not None and life[k] > decode_kv_tokens:
                raise ConfigError(f"decode_kv_tokens={decode_kv_tokens}: below request {k}'s "
                                  f"{int(life[k])} tokens (it could never decode)")
            load[a] += 1
            pload[p] += 1
            p_queue[p].append(k)
        # 3. idle prefill replicas take a step
        for p in range(n_p):
            if p_busy[p] is not None or not p_queue[p]:
                continue
            work, room, tok, ctxw, rows = [], budget, 0, 0.0, 0
            for k in p_queue[p][:cfg.max_num_seqs]:
                if room <= 0:
                    break
                ns = int(min(P[k] - computed[k], room))
                work.append((k, ns))
                room -= ns
                tok += ns
                ctxw += ns * (computed[k] + (ns + 1) / 2)
                rows += int(computed[k] + ns >= P[k])
            ta, te = pre.step_s(tok, ctxw / tok, rows, len(work))
            ta += cfg.iteration_overhead_s
            psteps.append([p, t, ta + te, tok])
            p_busy[p] = PrefillStep(t + ta + te, t, work, ta, te, psteps[-1], ta + te, 1.0, t)
        n_busy = sum(b is not None for b in p_busy)  # prefill replicas computing from here on
        # 4. an idle decode pool starts an iteration with what is runnable at t
        if d_busy is None:
            for a in range(n_a):
                if decode_kv_tokens is None:
                    go = [k for k in d_wait[a] if ready[k] <= t]
                else:
                    go = _fits(d_wait[a], ready, t, off, life, kv_used, a, decode_kv_tokens)
                if go:
                    gone = set(go)
                    d_wait[a] = [k for k in d_wait[a] if k not in gone]
                    d_run[a].extend(go)
                    for k in go:
                        book.started(k)
            delay = 0.0  # KV coming home first: the replica waits for it between two iterations
            for k in going_home:
                if np.isnan(fin[k]):
                    p, a = pre_of[k], dec_of[k]
                    off[k], homed[k] = False, True
                    go = max(t, egress[p], ingress[a])
                    egress[p] = ingress[a] = go + computed[k] * kvb / bw
                    delay = max(delay, egress[p] + lat - t)
                    kv_used[a] += life[k]
            going_home = []
            if any(d_run):
                tok, ctx, rows = np.zeros((n_a, m)), np.zeros((n_a, m)), np.zeros((n_a, m))
                work = []
                for a in range(n_a):
                    ids = np.array(d_run[a][:cfg.max_num_batched_tokens], np.int64)
                    if len(ids):
                        mb = _split(np.ones(len(ids)), m)
                        tok[a] = np.bincount(mb, minlength=m)
                        # offloaded rows' KV is read on their prefill replica: no local context
                        ctx[a] = np.bincount(mb, np.where(off[ids], 0.0, computed[ids] + 1.0), m)
                        rows[a] = tok[a]
                    work.append((a, ids))
                ctx = np.divide(ctx, tok, out=np.zeros_like(ctx), where=tok > 0)
                counts = draw_counts(probs, tok.sum(axis=0), s.top_k, s.num_experts, s.num_layers, rng)
                busy = np.minimum(ingress, t + msg)  # E2A waits for the KV message in flight
                pipe = node.pipeline(n_busy)
                rt, used = None, None
                if book.active:
                    rt, used = _remote(remote, work, off, pre_of, computed, p_busy, m, n_p, s.num_layers)
                    trips.extend(rt[rt > 0].tolist())
                end = pipe.iteration(t, tok, ctx, rows, counts, ingress_free=busy, remote_s=rt)
                end += cfg.iteration_overhead_s + delay
                if used is not None:  # p's share of the iteration left to its prefill steps
                    share = np.maximum(1.0 - s.num_layers * used / max(end - t, 1e-300), 0.05)
                iters.append((t, end - t, float(tok.sum())))
                d_busy = (end, work)
        # 5. prefill steps' rates under what now runs beside them; the next event
        for p, b in enumerate(p_busy):
            if b is not None:
                r = node.rate(b.attn_s, b.exp_s, n_busy, d_busy is not None)
                if book.active and d_busy is not None:
                    r *= share[p]
                if r != b.rate:
                    b.rate, b.end = r, t + b.left / r
        cand = [b.end for b in p_busy if b is not None]
        if d_busy is not None:
            cand.append(d_busy[0])
        else:
            cand += [ready[k] for w in d_wait for k in w]
        if nxt < n:
            cand.append(float(A[order[nxt]]))
        if not cand:
            break
        t = max(t, min(cand))
    return PdJobResult(A, first, fin, O, iters, None, [tuple(x) for x in psteps], ready,
                       offloaded=ever_off, round_trip_s=np.array(trips), returned_home=homed)


def _fits(wait: list, ready, t: float, off, life, kv_used, a: int, cap: int) -> list:
    """The requests of ``wait`` that start decoding on replica ``a`` at ``t``: ready, and, for a
    local one, its life's KV fits beside ``kv_used[a]`` (FCFS: a local one that does not fit
    holds back the local ones after it); ``kv_used[a]`` takes theirs."""
    go, blocked = [], False
    for k in wait:
        if ready[k] > t:
            continue
        if not off[k]:
            if blocked or kv_used[a] + life[k] > cap:
                blocked = True
                continue
            kv_used[a] += life[k]
        go.append(k)
    return go


def _answer_wait(step, layer_wait: float, L: int) -> float:
    """How long a prefill replica with ``step`` in flight (None: idle) makes an offloaded
    message wait: ``layer_wait`` (half, this runtime) of its step's layer, at its rate."""
    return 0.0 if step is None else layer_wait * (step.attn_s + step.exp_s) / (L * step.rate)


def _remote(remote: RemoteAttention, work: list, off, pre_of, computed, p_busy: list, m: int,
            n_p: int, L: int):
    """(round trip [n_a, m] s per layer, prefill seconds [n_p] per layer) of an iteration's
    offloaded rows (``work``: [(replica, ids)] in micro-batch order, as the iteration's)."""
    n_a = len(work)
    cnt, csum = np.zeros((n_a, m, n_p)), np.zeros((n_a, m, n_p))
    for a, ids in work:
        if len(ids):
            mb = _split(np.ones(len(ids)), m)
            o = off[ids]
            np.add.at(cnt, (a, mb[o], pre_of[ids[o]]), 1.0)
            np.add.at(csum, (a, mb[o], pre_of[ids[o]]), computed[ids[o]] + 1.0)
    wait = np.array([_answer_wait(b, remote.off.layer_wait, L) for b in p_busy])
    return remote.layer(cnt, csum, wait)
