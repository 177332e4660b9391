"""EPLB under mpiexec: static placements and live rebalancing leave greedy tokens unchanged,
and after the moves every slot holds its logical expert's weights.

    mpiexec -n 3 python eplb_job.py OUT.json CKPT [QUANTIZATION]
Runs (1 attention rank + 2 expert ranks, m=2): a shuffled static placement with 2 redundant
slots, then live EPLB every 3 iterations. OUT.json: tokens per run, rebalance and move counts
and the weight check of every expert rank.
"""
import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))

from mpi4py import MPI  # noqa: E402

from abort_on_error import run_or_abort  # noqa: E402
from runtime_job import CACHE, SCHED, inputs  # noqa: E402

from megainfer.config import CommConfig, DeployPlan, EplbConfig, LoadConfig, ModelConfig  # noqa: E402
from megainfer.models import build_model  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402

RUNS = {
    "static_shuffled": EplbConfig(redundant_experts=2, initial="shuffled", seed=5),
    "live": EplbConfig(enabled=True, redundant_experts=2, window=3, interval=3),
}


def check_weights(r, cfg, load) -> bool:
    """Expert rank: does every local slot hold exactly its logical expert's checkpoint weights?"""
    reb = r.worker.rebalancer
    p, mine = reb.placement, list(reb.placement.slots_of_rank(reb.index))
    ref = build_model(cfg, load, role="experts", expert_slots=[mine] * cfg.num_layers,
                      phy2log=p.phy2log.tolist())
    return all(torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8))  # stored bytes
               for a, b in zip(r.worker.model.layers, ref.layers) if a.is_moe
               for s in range(len(mine))
               for x, y in zip(a.mlp.experts.slot_tensors(s), b.mlp.experts.slot_tensors(s)))


def run_and_gather(job: ResolvedJob, vocab_size: int, max_tokens: int, expert_stats):
    """One job: (rank 0's greedy tokens, every expert rank's ``expert_stats(rank)``) on rank 0,
    (None, None) elsewhere. Rank 0's stream is consumed before the gather."""
    comm = MPI.COMM_WORLD
    r = build_rank(job)
    stream = run_job(r, inputs(vocab_size, max_tokens))
    tokens = {o.request_id: o.outputs[0].token_ids for o in stream} if stream else None
    gathered = comm.gather(expert_stats(r) if r.worker is not None else None, root=0)
    r.close()
    if comm.Get_rank() != 0:
        return None, None
    return tokens, [g for g in gathered if g is not None]


def main():
    out, ckpt = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    quant = sys.argv[3] if len(sys.argv) > 3 else None  # model.quantization (group 32)
    cfg = ModelConfig.from_pretrained(ckpt)
    load = LoadConfig(path=ckpt, quantization=quant, quantization_group_size=32)
    plan = DeployPlan(mode="disaggregated", expert_ranks=2, micro_batches=2)
    result = {}

    def stats(r):
        reb = r.worker.rebalancer
        return reb.rebalances, reb.moved, check_weights(r, cfg, load), reb.placement.phy2log.tolist()
    for name, eplb in RUNS.items():
        job = ResolvedJob(cfg, load, SCHED, CACHE, plan, CommConfig(timeout_s=120), eplb)
        tokens, experts = run_and_gather(job, cfg.vocab_size, 12, stats)
        if comm.Get_rank() == 0:
            result[name] = {"tokens": tokens, "rebalances": [e[0] for e in experts],
                            "moved": [e[1] for e in experts], "weights_ok": [e[2] for e in experts],
                            "phy2log": experts[0][3]}
    if comm.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    run_or_abort(main)
