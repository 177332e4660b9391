"""One mpiexec launch for perf/bench/bench_pd.py: one deploy layout (with or without prefill ranks),
bench50m dummy weights, each workload after a warm-up job; rank 0 writes per workload the job
time, per-request TTFT / TPOT / prefill-end-to-decode-start, and the prefill ranks' KV transfer
figures (bytes sent, transfer time, the part of it not hidden behind prefill compute).

    mpiexec -n K python perf/jobs/pd_bench_job.py OUT.json '{"A": 1, "E": 2, "P": 1, "m": 2, ...}'

``PTP``: deploy.prefill_tp (default 1); every TP rank of a prefill replica reports its stats.
``cpu_s``: each rank's [role, CPU seconds of its process during the job] (what it took from
the shared cores, waits included when they spin). ``trace``: true to trace the measured jobs (``trace.enabled``): rank 0 adds ``spans``, every
rank's spans as [rank, lane, iteration, layer, micro-batch, tokens, start ms, duration ms] (the
prefill ranks' ``prefill`` lane: one span per step; the decode ranks' attention / expert spans).
"""
import json
import random
import sys
import time

import torch
from mpi4py import MPI

torch.set_num_threads(1)

from megainfer.bench.shapes import BENCH50M  # noqa: E402
from megainfer.config import (CacheConfig, CommConfig, DeployPlan, EplbConfig, LoadConfig,  # noqa: E402
                              SchedulerConfig, TraceConfig)
from megainfer.engine.outputs import PromptInput  # noqa: E402
from megainfer.engine.sampling_params import SamplingParams  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402


def inputs(w: dict, seed: int):
    g = random.Random(seed)
    sp = SamplingParams(temperature=0, max_tokens=w["output_len"], ignore_eos=True)
    return [PromptInput(f"q{i}", prompt_token_ids=[g.randrange(3, 8192) for _ in range(w["prompt_len"])],
                        params=sp) for i in range(w["num"])]


def run(a: dict, cfg, w: dict, seed: int, trace: bool = False):
    plan = DeployPlan(mode="disaggregated", attention_replicas=a["A"], expert_ranks=a["E"],
                      micro_batches=a["m"], prefill_replicas=a["P"],
                      prefill_tp=a.get("PTP", 1))
    sched = SchedulerConfig(a["max_num_seqs"], a["max_num_batched_tokens"],
                            w["prompt_len"] + w["output_len"])
    r = build_rank(ResolvedJob(cfg, LoadConfig(load_format="dummy"), sched,
                           CacheConfig(a["block_size"], a["num_blocks"]), plan,
                           CommConfig(timeout_s=600, transport="mpi"), EplbConfig(),
                           TraceConfig(enabled=trace)))
    MPI.COMM_WORLD.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    stream = run_job(r, inputs(w, seed))
    outs = None if stream is None else list(stream)
    seconds = time.perf_counter() - t0
    cpu = MPI.COMM_WORLD.gather([r.role.kind, time.process_time() - c0], root=0)
    stats = r.worker.stats() if r.role.kind == "prefill" else None
    stats = MPI.COMM_WORLD.gather(stats, root=0)
    spans = MPI.COMM_WORLD.gather([[MPI.COMM_WORLD.Get_rank(), e["cat"], e["args"]["iter"], e["args"]["layer"],
                                    e["args"]["mb"], e["args"]["tokens"], round(e["ts"] / 1e3, 3),
                                    round(e["dur"] / 1e3, 3)]
                                   for e in r.tracer.events] if trace else [], root=0)
    r.close()
    if outs is None:
        return None
    m = [o.metrics for o in outs]
    return dict(seconds=seconds, ttft_s=[x.ttft for x in m],
                tpot_s=[x.tpot(w["output_len"]) for x in m],
                handoff_s=[x.kv_handoff_s for x in m if x.kv_handoff_s is not None],
                prefill=[s for s in stats if s is not None],
                tokens={o.request_id: o.outputs[0].token_ids for o in outs},
                cpu_s=cpu,
                **({"spans": [x for s in spans for x in s]} if trace else {}))


def main():
    out, a = sys.argv[1], json.loads(sys.argv[2])
    cfg = BENCH50M
    res = {}
    for w in a["workloads"]:
        run(a, cfg, dict(w, num=2, output_len=2), seed=99)  # warm-up
        res[w["name"]] = run(a, cfg, w, seed=7, trace=bool(a.get("trace")))
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
