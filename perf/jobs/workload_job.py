"""One workload (a jsonl of requests with arrival times) on a disaggregated layout, under mpiexec.

    mpiexec -n A+E python perf/jobs/workload_job.py OUT.json TRACE.jsonl --replicas A --m M [--zipf Z]

TRACE.jsonl: one request a line, {"arrival_s", "prompt_len", "output_len"} (the simulator's
``events.read_request_trace`` format). The runtime's own loop (runtime/replicas/loop.py) queues
every request at once, so this job drives the attention ranks with the same lock-step protocol
(engine.step, then leaders report (finished, busy) to rank 0 and rank 0 answers go) and adds
two things: each replica queues a request only once its arrival time has passed (checked at
iteration boundaries, on the node's shared monotonic clock), and when every replica is idle
rank 0 tells all of them to sleep until the next arrival (no empty iterations while idle, as the
simulator jumps). Request i goes to replica i mod A, as in the runtime.

A warm-up batch (4 requests, 3 tokens) runs first and is not measured. ``--zipf Z`` biases the
router (perf/jobs/eplb_job.bias_routers); every run counts the (token, expert) pairs the routers
chose per layer during the measured phase, so the simulator can be fed the recorded load.
Rank 0 writes per-request arrival / first-token / finish times (seconds from the start) and
the per-step log. ``--trace-dir DIR``: every rank's trace (docs/trace_format.md), merged into
DIR/trace.json.
"""
import argparse
import json
import os
import time
from collections import deque

import torch

torch.set_num_threads(1)

from mpi4py import MPI  # noqa: E402

from eplb_job import bias_routers  # noqa: E402
from pipeline_job import SHAPE_DEFAULTS, model_config  # noqa: E402

from megainfer.config import (CacheConfig, CommConfig, DeployPlan, EplbConfig,  # noqa: E402
                              LoadConfig, SchedulerConfig, TraceConfig)
from megainfer.engine.sampling_params import SamplingParams  # noqa: E402
from megainfer.runtime.tags import GO as TAG_GO, REQUESTS as TAG_REQUESTS, STATUS as TAG_STATUS  # noqa: E402
from megainfer.runtime.trace import merge_traces  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.runtime.startup import build_rank, run_rank  # noqa: E402


def count_routes(model, counts: torch.Tensor) -> None:
    """Wrap each MoE router so the expert ids it picks are added to ``counts`` [layers, E]."""
    for li, layer in enumerate(model.layers):
        if not layer.is_moe:
            continue
        gate, inner = layer.mlp.gate, layer.mlp.gate.forward

        def forward(x, inner=inner, li=li):
            w, ids = inner(x)
            counts[li] += torch.bincount(ids.reshape(-1), minlength=counts.shape[1])
            return w, ids
        gate.forward = forward


def drive(r, mine: list, t0: float, n_total: int) -> list:
    """The lock-step loop with arrival release; ``mine``: [(arrival_s, rid, tokens, max_tokens)].
    Returns rank 0's records (others: [])."""
    loop, comm_rank = r.loop, r.role.rank
    eng, ctl = loop.engine, loop.control
    pending, recs = deque(sorted(mine)), []
    go = True
    while go:
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            a, rid, toks, n = pending.popleft()
            eng.add_request(rid, prompt_token_ids=toks,
                            params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        fin = [(o.request_id, o.metrics.first_token_time - t0, o.metrics.finished_time - t0,
                len(o.outputs[0].token_ids)) for o in eng.step()]
        nxt = pending[0][0] if pending else float("inf")
        busy = eng.has_unfinished()
        if comm_rank != 0:
            ctl.send((fin, busy, nxt), 0, TAG_STATUS)
            go, wake = ctl.recv(0, TAG_GO, "iteration sync (waiting for rank 0)")
        else:
            recs += fin
            for leader in loop.leaders[1:]:
                f, b, x = ctl.recv(leader, TAG_STATUS, "iteration sync (replica status)")
                recs += f
                busy, nxt = busy or b, min(nxt, x)
            go = len(recs) < n_total
            wake = nxt if go and not busy else None
            for rank in loop.attn_ranks[1:]:
                ctl.send((go, wake), rank, TAG_GO)
        if go and wake is not None:
            time.sleep(max(0.0, t0 + wake - time.perf_counter()))
    return recs


def write_trace(r, trace_dir, comm) -> None:
    """Every rank writes its trace; rank 0 merges them into ``trace_dir``/trace.json."""
    if not trace_dir:
        return
    os.makedirs(trace_dir, exist_ok=True)
    r.tracer.write(trace_dir)
    comm.Barrier()
    if comm.Get_rank() == 0:
        merge_traces([os.path.join(trace_dir, f"trace.rank{k}.json") for k in range(comm.Get_size())],
                     os.path.join(trace_dir, "trace.json"), {"job": "workload_job"})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("trace")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--zipf", type=float, default=0.0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--trace-dir", default=None, help="per-rank traces, merged into trace.json")
    for name, default in SHAPE_DEFAULTS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default)
    a = ap.parse_args()
    with open(a.trace) as f:
        reqs = [json.loads(x) for x in f if x.strip()]
    comm = MPI.COMM_WORLD
    A = a.replicas
    plan = DeployPlan(mode="disaggregated", attention_replicas=A, expert_ranks=comm.Get_size() - A,
                      micro_batches=a.m)
    max_len = max(q["prompt_len"] + q["output_len"] for q in reqs) + 8
    sched = SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                            max_model_len=max_len)
    cache = CacheConfig(block_size=16, num_blocks=len(reqs) * (max_len // 16 + 2) + 16)
    r = build_rank(ResolvedJob(model_config(a), LoadConfig(load_format="dummy", seed=0), sched, cache, plan,
                           CommConfig(timeout_s=120, transport="mpi"), EplbConfig(), TraceConfig(enabled=a.trace_dir is not None)), comm)
    if r.loop is None:  # expert rank: serve until the attention side says stop
        run_rank(r)
        write_trace(r, a.trace_dir, comm)
        r.close()
        return
    model = r.loop.engine.executor.model
    if a.zipf:
        bias_routers(model, a.zipf, seed=1)
    counts = torch.zeros(a.layers, a.experts, dtype=torch.long)
    count_routes(model, counts)
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(3, a.vocab, (q["prompt_len"],), generator=g).tolist() for q in reqs]
    rank, rep = r.role.rank, r.role.rank // plan.attention_tp
    ctl = r.loop.control
    warm = [(0.0, f"w{i}", toks[0][:8], 3) for i in range(4 * A) if i % A == rep]
    for phase, items in (("warm", warm), ("run", None)):
        if items is None:
            counts.zero_()
            items = [(q["arrival_s"], f"r{i}", toks[i], q["output_len"])
                     for i, q in enumerate(reqs) if i % A == rep]
        if rank == 0:  # one start time for every attention rank (perf_counter: CLOCK_MONOTONIC)
            t0 = time.perf_counter() + 0.05
            for other in r.loop.attn_ranks[1:]:
                ctl.send(t0, other, TAG_REQUESTS)
        else:
            t0 = ctl.recv(0, TAG_REQUESTS, "start time")
        time.sleep(max(0.0, t0 - time.perf_counter()))
        n_total = 4 * A if phase == "warm" else len(reqs)
        steps0 = len(r.loop.engine.executor.step_log)
        recs = drive(r, items, t0, n_total)
    r.loop.exchange.stop(r.loop.engine.executor.iteration, r.loop.first_moe_layer)
    gathered = [counts]  # replicas' route counts to rank 0 (one message each, after the loop)
    if rank == 0:
        gathered += [torch.tensor(ctl.recv(ld, TAG_STATUS, "route counts")) for ld in r.loop.leaders[1:]]
    elif r.role.is_leader:
        ctl.send(counts.tolist(), 0, TAG_STATUS)
    if rank == 0:
        recs.sort(key=lambda x: int(x[0][1:]))
        steps = r.loop.engine.executor.step_log[steps0:]
        with open(a.out, "w") as f:
            json.dump({"requests": [{"id": rid, "arrival_s": reqs[int(rid[1:])]["arrival_s"],
                                     "first_token_s": ft, "finish_s": fs, "output_len": n}
                                    for rid, ft, fs, n in recs],
                       "steps": steps, "route_counts": sum(gathered).tolist(),
                       "replicas": A, "expert_ranks": plan.expert_ranks, "m": a.m, "zipf": a.zipf,
                       "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
                       "shape": {k: getattr(a, k) for k in SHAPE_DEFAULTS}}, f)
    write_trace(r, a.trace_dir, comm)
    r.close()


if __name__ == "__main__":
    main()
