"""One mpiexec launch for perf/bench/bench_pd_offload.py: 1 prefill rank + 1 decode attention
rank + 2 expert ranks (bench50m dummy weights, fp32), one workload with ``pd.offload`` off or
on; rank 0 writes the job time, the tokens, the decode engine's largest batch and preemptions,
and the offload figures of every rank (decode: per-layer round trips, their total and exposed
seconds; prefill: requests kept, messages served and the seconds spent serving them).

    mpiexec -n 4 python perf/jobs/pd_offload_bench_job.py OUT.json '{"offload": true, ...}'
"""
import json
import random
import sys
import time

import torch
from mpi4py import MPI

torch.set_num_threads(1)

from megainfer.bench.shapes import BENCH50M  # noqa: E402
from megainfer.config import (CacheConfig, CommConfig, DeployPlan, LoadConfig, PdConfig,  # noqa: E402
                              ResolvedJob, SchedulerConfig)
from megainfer.core_client.client import run_job  # noqa: E402
from megainfer.engine.outputs import PromptInput  # noqa: E402
from megainfer.engine.sampling_params import SamplingParams  # noqa: E402
from megainfer.runtime.pd.loop import PDReplicaLoop  # noqa: E402
from megainfer.runtime.pd.prefill_worker import PrefillWorker  # noqa: E402
from megainfer.runtime.startup import build_rank  # noqa: E402


def inputs(a: dict, num: int, out_len: int, seed: int):
    g = random.Random(seed)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    return [PromptInput(f"q{i}", prompt_token_ids=[g.randrange(3, 8192)
                                                   for _ in range(a["prompt_len"])], params=sp)
            for i in range(num)]


def offload_figures(r) -> dict:
    if isinstance(r.worker, PrefillWorker):
        pool = r.worker.executor.offload
        return {} if pool is None else dict(role="prefill", kept=pool.kept, served=pool.served,
                                            serve_s=pool.serve_s)
    client = r.loop.decode.offload if isinstance(r.loop, PDReplicaLoop) else None
    if client is None:
        return {}
    t = client.trips
    return dict(role="decode", started=client.started, returned=client.returned,
                trips=t.count, trip_s=t.total_s, exposed_s=t.exposed_s)


def run(a: dict, num: int, out_len: int, seed: int, offload: bool):
    plan = DeployPlan(mode="disaggregated", attention_replicas=1, expert_ranks=2,
                      micro_batches=a["m"], prefill_replicas=1)
    sched = SchedulerConfig(a["max_num_seqs"], a["max_num_batched_tokens"],
                            a["prompt_len"] + a["output_len"])
    pd = PdConfig(offload=offload, offload_blocks=a["offload_blocks"]) if offload else PdConfig()
    r = build_rank(ResolvedJob(BENCH50M, LoadConfig(load_format="dummy"), sched,
                               CacheConfig(a["block_size"], a["num_blocks"]), plan,
                               CommConfig(timeout_s=600, transport="mpi"), pd=pd))
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    stream = run_job(r, inputs(a, num, out_len, seed))
    outs = None if stream is None else list(stream)
    seconds = time.perf_counter() - t0
    figs = MPI.COMM_WORLD.gather(offload_figures(r), root=0)
    res = None
    if outs is not None:
        eng = r.loop.engine
        steps = eng.executor.step_log
        res = dict(seconds=seconds, tokens={o.request_id: o.outputs[0].token_ids for o in outs},
                   output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                   max_batch=max((s for s, _, _ in steps), default=0),
                   decode_steps=len(steps), preemptions=eng.num_preemptions,
                   offload=[f for f in figs if f])
    r.close()
    return res


def main():
    out, a = sys.argv[1], json.loads(sys.argv[2])
    run(a, 2, 2, 99, a["offload"])  # warm-up
    res = run(a, a["num"], a["output_len"], 7, a["offload"])
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
