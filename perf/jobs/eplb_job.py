"""One run of the EPLB runtime benchmark (perf/bench/bench_eplb.py --runtime), under mpiexec -n 3.

1 attention rank + 2 expert ranks, dummy weights, a router biased towards a few experts (a
Zipf logit bias over a random expert order per layer, added to the real router's logits), live
EPLB every ``--interval`` iterations. Rank 0 writes the duration of every step, and every
expert rank the (token, slot) pairs it served per iteration, so decode time and per-rank load
can be compared before and after the first rebalance of the same run.
"""
import argparse
import json
import os

import torch

torch.set_num_threads(1)

from mpi4py import MPI  # noqa: E402

from megainfer.config import (CacheConfig, CommConfig, DeployPlan, EplbConfig,  # noqa: E402
                              LoadConfig, ModelConfig, SchedulerConfig, TraceConfig)
from megainfer.engine.outputs import PromptInput  # noqa: E402
from megainfer.engine.sampling_params import SamplingParams  # noqa: E402
from megainfer.kernels import select_experts  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402


def bias_routers(model, zipf: float, seed: int) -> None:
    """Add a fixed per-layer logit bias to each router: expert of popularity rank r gets
    -zipf * log(r + 1), so a few experts take most tokens (the workload generator)."""
    g = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        if not layer.is_moe:
            continue
        gate = layer.mlp.gate
        E = gate.weight.shape[0]
        order = torch.randperm(E, generator=g)
        bias = torch.empty(E)
        bias[order] = -zipf * torch.log(torch.arange(E, dtype=torch.float32) + 1)

        def forward(x, bias=bias, gate=gate):
            logits = torch.nn.functional.linear(x, gate.weight) + bias
            w, ids = select_experts(logits, gate.top_k, renormalize=gate.renormalize)
            return w.to(x.dtype), ids
        gate.forward = forward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    for name, d in (("hidden", 256), ("inter", 2048), ("layers", 4), ("experts", 8), ("top_k", 2),
                    ("kv_heads", 2), ("batch", 512), ("prompt", 16), ("decode", 40), ("interval", 12),
                    ("redundant", 2)):
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=d)
    ap.add_argument("--zipf", type=float, default=1.5)
    ap.add_argument("--static", action="store_true", help="control run: no EPLB, identity placement")
    ap.add_argument("--trace", default=None, help="directory for per-rank traces (optional)")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    cfg = ModelConfig(family="mixtral", vocab_size=512, hidden_size=a.hidden, num_layers=a.layers,
                      num_heads=8, num_kv_heads=a.kv_heads, head_dim=a.hidden // 8, num_experts=a.experts,
                      top_k=a.top_k, moe_intermediate_size=a.inter, max_position_embeddings=4096)
    sched = SchedulerConfig(max_num_seqs=a.batch, max_num_batched_tokens=a.batch * a.prompt,
                            max_model_len=a.prompt + a.decode + 8)
    cache = CacheConfig(block_size=16, num_blocks=a.batch * 5)
    eplb = EplbConfig() if a.static else EplbConfig(enabled=True, redundant_experts=a.redundant,
                                                    window=a.interval, interval=a.interval)
    plan = DeployPlan(mode="disaggregated", expert_ranks=2, micro_batches=1)
    r = build_rank(ResolvedJob(cfg, LoadConfig(load_format="dummy"), sched, cache, plan,
                           CommConfig(timeout_s=120), eplb, TraceConfig(enabled=a.trace is not None)))
    if r.loop is not None:
        bias_routers(r.loop.engine.executor.model, a.zipf, seed=1)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=a.decode, ignore_eos=True)
    inputs = [PromptInput(f"r{i}", prompt_token_ids=torch.randint(3, 512, (a.prompt,), generator=g).tolist(),
                          params=params) for i in range(a.batch)]
    stream = run_job(r, inputs)
    if stream is not None:
        list(stream)
    mine = None
    if r.worker is not None:
        reb = r.worker.rebalancer
        mine = {"tokens_per_iteration": reb.tokens_per_iteration, "rebalances": reb.rebalances,
                "moved": reb.moved}
    gathered = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        steps = r.loop.engine.executor.step_log
        with open(a.out, "w") as f:
            json.dump({"steps": steps, "experts": [x for x in gathered if x is not None],
                       "interval": a.interval, "batch": a.batch,
                       "shape": {k: getattr(a, k) for k in ("hidden", "inter", "layers", "kv_heads", "experts",
                                                            "top_k", "zipf", "redundant")}}, f)
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
        r.tracer.write(a.trace)
    r.close()


if __name__ == "__main__":
    main()
