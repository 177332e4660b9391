"""One mpiexec launch for perf/bench/bench_replan.py: one starting split, re-planning on or off,
bench50m dummy weights; a warm-up job, then the measured job. Rank 0 writes the job time, the
greedy tokens, each switch's record, the decisions, and rank 0's step log split into phases at
the switches (mean decode iteration time of each phase).

    mpiexec -n K python perf/jobs/replan_bench_job.py OUT.json '{"A": 1, "E": 3, "m": 2,
        "segments": [[num, prompt_len, output_len], ...], "replan": {...} or null, ...}'

``segments``: the requests in order (rank 0 hands them out first come first served), e.g. short
prompts first, long ones after: the balance of attention and expert work shifts as the job runs.
"""
import json
import random
import statistics
import sys
import time

import torch
from mpi4py import MPI

torch.set_num_threads(1)

from megainfer.bench.shapes import BENCH50M  # noqa: E402
from megainfer.config import (CacheConfig, CommConfig, DeployPlan, LoadConfig,  # noqa: E402
                              ReplanConfig, SchedulerConfig, TraceConfig)
from megainfer.engine.outputs import PromptInput  # noqa: E402
from megainfer.engine.sampling_params import SamplingParams  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402


def inputs(segments, seed: int):
    g, out = random.Random(seed), []
    for s, (num, plen, olen) in enumerate(segments):
        sp = SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True)
        out += [PromptInput(f"s{s}q{i}", prompt_token_ids=[g.randrange(3, 8192) for _ in range(plen)],
                            params=sp) for i in range(num)]
    return out


def run(a: dict, cfg, segments, replan):
    plan = DeployPlan(mode="disaggregated", attention_replicas=a["A"], expert_ranks=a["E"],
                      micro_batches=a["m"])
    longest = max(p + o for _, p, o in segments)
    sched = SchedulerConfig(a["max_num_seqs"], a["max_num_batched_tokens"], longest)
    r = build_rank(ResolvedJob(cfg, LoadConfig(load_format="dummy"), sched,
                           CacheConfig(a["block_size"], a["num_blocks"]), plan,
                           CommConfig(timeout_s=600, transport="mpi"),
                           trace=TraceConfig(enabled=bool(a.get("trace"))), replan=replan))
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    stream = run_job(r, inputs(segments, a.get("seed", 0)))
    outs = None if stream is None else list(stream)
    seconds = time.perf_counter() - t0
    res = None
    if outs is not None:
        steps = r.loop.engine.executor.step_log  # rank 0 keeps its engine across switches
        recs = r.replans
        res = dict(seconds=seconds, tokens={o.request_id: o.outputs[0].token_ids for o in outs},
                   replans=recs, decisions=r.replan_decisions,
                   phases=phases(steps, [x["iteration"] for x in recs]),
                   switch_s=sum(x["seconds"] for x in recs))
    r.close()
    return res


def phases(steps, cuts):
    """Rank 0's steps split at the switch iterations: count and median seconds of each."""
    out, bounds = [], [0] + list(cuts) + [len(steps)]
    for lo, hi in zip(bounds, bounds[1:]):
        secs = [s for _, _, s in steps[lo:hi]]
        out.append(dict(first_iteration=lo, steps=len(secs),
                        median_step_ms=1e3 * statistics.median(secs) if secs else None,
                        seconds=sum(secs)))
    return out


def main():
    out, a = sys.argv[1], json.loads(sys.argv[2])
    cfg = BENCH50M
    replan = ReplanConfig(**a["replan"]) if a.get("replan") else ReplanConfig()
    run(a, cfg, [[2 * a["A"], 8, 4]], ReplanConfig())  # warm-up
    res = run(a, cfg, a["segments"], replan)
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
