"""One launch of the pipeline benchmark (run by perf/bench/bench_pipeline.py under mpiexec -n 2).

    mpiexec -n 2 python perf/jobs/pipeline_job.py OUT.json CONFIGS [--hidden H --inter N ...]
CONFIGS: comma list of <mode>:<m>[:trace], mode in disaggregated (1 attention + 1 expert rank)
| colocated (2 ranks). Every config decodes the same batch (dummy weights); rank 0 records the
duration of every step; with :trace it also writes and merges the per-rank traces.
"""
import argparse
import json
import os
import time

import torch

torch.set_num_threads(1)

from mpi4py import MPI  # noqa: E402

from megainfer.config import (CacheConfig, CommConfig, DeployPlan, EplbConfig,  # noqa: E402
                              LoadConfig, ModelConfig, SchedulerConfig, TraceConfig)
from megainfer.engine.outputs import PromptInput  # noqa: E402
from megainfer.engine.sampling_params import SamplingParams  # noqa: E402
from megainfer.runtime.trace import merge_traces  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402


# the shape of conf/plan_model/cpu_small.yaml, which the performance model is calibrated on
SHAPE_DEFAULTS = {"hidden": 512, "inter": 1024, "layers": 4, "heads": 8, "kv_heads": 4, "experts": 8,
                  "top_k": 2, "vocab": 4096, "batch": 64, "prompt": 16, "decode": 24}
SHAPE_KEYS = tuple(SHAPE_DEFAULTS)


def model_config(a) -> ModelConfig:
    return ModelConfig(family="mixtral", vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers,
                       num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                       num_experts=a.experts, top_k=a.top_k, moe_intermediate_size=a.inter,
                       max_position_embeddings=4096)


def run_config(a, mode: str, m: int, trace_dir: str | None) -> dict:
    comm = MPI.COMM_WORLD
    disagg = mode == "disaggregated"
    plan = DeployPlan(mode=mode, attention_replicas=a.replicas if disagg else comm.Get_size(),
                      expert_ranks=comm.Get_size() - a.replicas if disagg else 0, micro_batches=m)
    sched = SchedulerConfig(max_num_seqs=a.batch, max_num_batched_tokens=max(a.batch * a.prompt, 256),
                            max_model_len=a.prompt + a.decode + 8)
    cache = CacheConfig(block_size=16, num_blocks=a.batch * ((a.prompt + a.decode) // 16 + 2))
    rank = build_rank(ResolvedJob(model_config(a), LoadConfig(load_format="dummy", seed=0), sched, cache,
                              plan, CommConfig(timeout_s=120, wait_mode=a.wait), EplbConfig(),
                              TraceConfig(enabled=trace_dir is not None)), comm)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=a.decode, ignore_eos=True)
    inputs = [PromptInput(f"r{i}", prompt_token_ids=torch.randint(3, a.vocab, (a.prompt,), generator=g).tolist(),
                          params=params) for i in range(a.batch)]
    t0 = time.perf_counter()
    stream = run_job(rank, inputs)
    outs = list(stream) if stream is not None else []
    wall = time.perf_counter() - t0
    result = None
    if comm.Get_rank() == 0:
        steps = rank.loop.engine.executor.step_log
        per_replica = a.batch // plan.attention_replicas
        decode = [dt for seqs, toks, dt in steps if seqs == toks == per_replica]
        result = {"mode": mode, "m": m, "wall_s": wall, "decode_steps": len(decode),
                  "attention_replicas": plan.attention_replicas, "expert_ranks": plan.expert_ranks,
                  "batch": a.batch, "shape": {k: getattr(a, k) for k in SHAPE_KEYS},
                  "decode_iter_s": sorted(decode)[len(decode) // 2] if decode else None,
                  "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
        result["decode_tokens_per_s"] = a.batch / result["decode_iter_s"] if decode else None
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        rank.tracer.write(trace_dir)
        comm.Barrier()
        if comm.Get_rank() == 0:
            paths = [os.path.join(trace_dir, f"trace.rank{r}.json") for r in range(comm.Get_size())]
            result["trace"] = merge_traces(paths, os.path.join(trace_dir, "trace.json"),
                                           {"mode": mode, "micro_batches": m})
    rank.close()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("configs")
    for name, default in SHAPE_DEFAULTS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default)
    ap.add_argument("--wait", default="backoff")
    ap.add_argument("--replicas", type=int, default=1, help="disaggregated: attention replicas; "
                    "the other ranks are expert ranks")
    ap.add_argument("--trace-root", default="/tmp/megainfer_pipeline_traces")
    a = ap.parse_args()
    results = []
    for c in a.configs.split(","):
        parts = c.split(":")
        trace_dir = os.path.join(a.trace_root, f"{parts[0]}_m{parts[1]}") if "trace" in parts else None
        results.append(run_config(a, parts[0], int(parts[1]), trace_dir))
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
