"""One mpiexec launch for perf/bench/bench_prefix_cache.py: 2 attention replicas + expert ranks
(disaggregated, bench50m dummy weights), the shared-prefix workload routed ``round_robin`` and
``cache_aware`` in turn (after a small warm-up job); rank 0 writes per policy the job time, the
prefix hit rate, the requests per replica and greedy tokens.

    mpiexec -n 3 python perf/jobs/prefix_routing_job.py OUT.json '{"systems": 8, ...}'
"""
import json
import os
import sys
import time

import torch
from mpi4py import MPI

torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))

from prefix_workload import workload  # noqa: E402

from megainfer.bench.shapes import BENCH50M  # noqa: E402

from megainfer.config import (CacheConfig, CommConfig, DeployPlan, LoadConfig,  # noqa: E402
                              SchedulerConfig)
from megainfer.engine.outputs import PromptInput  # noqa: E402
from megainfer.engine.sampling_params import SamplingParams  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402


class Args:
    def __init__(self, d):
        self.__dict__.update(d)


def run(a, cfg, plan, routing, prompts):
    max_len = a.system_len + a.suffix_len + a.output_len
    sched = SchedulerConfig(a.max_num_seqs, a.max_num_batched_tokens, max_len, routing=routing)
    cache = CacheConfig(a.block_size, a.routing_blocks)
    r = build_rank(ResolvedJob(cfg, LoadConfig(load_format="dummy"), sched, cache, plan,
                           CommConfig(timeout_s=600, transport="mpi")))
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    stream = run_job(r, [PromptInput(f"p{i}", prompt_token_ids=p, params=sp)
                          for i, p in enumerate(prompts)])
    res = None
    outs = None if stream is None else sorted(stream, key=lambda o: int(o.request_id[1:]))
    cpu = MPI.COMM_WORLD.gather(time.process_time() - c0, root=0)  # every rank's (polling too)
    if outs is not None:
        P = sum(len(p) for p in prompts)
        cached = sum(o.num_cached_tokens for o in outs)
        res = dict(seconds=time.perf_counter() - t0, cpu_seconds=sum(cpu), prompt_tokens=P, cached_prompt_tokens=cached,
                   hit_rate=cached / P, assigned=r.loop.router.assigned,
                   router_matched_blocks=r.loop.router.matched_blocks,
                   tokens=[o.outputs[0].token_ids for o in outs])
    r.close()
    return res


def main():
    out, a = sys.argv[1], Args(json.loads(sys.argv[2]))
    cfg = BENCH50M
    plan = DeployPlan(mode="disaggregated", attention_replicas=2, attention_tp=1,
                      expert_ranks=a.expert_ranks, micro_batches=2)
    prompts = workload(a)
    run(a, cfg, plan, "round_robin", prompts[:4])  # warm-up
    results = {p: run(a, cfg, plan, p, prompts) for p in ("round_robin", "cache_aware")}
    if results["round_robin"] is not None:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
