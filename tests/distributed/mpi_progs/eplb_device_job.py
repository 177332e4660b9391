"""Live EPLB with the weight moves device to device (comm.eplb_moves; runtime/eplb/weight_channel.py).

    mpiexec -n 3 python eplb_device_job.py OUT.json CKPT DEVICE MOVES
1 attention rank + 2 expert ranks, m = 2, live EPLB every 3 iterations with 2 redundant slots,
for each comm.eplb_moves in MOVES (comma list: device, mpi, auto). DEVICE: cpu (device moves
over the MPI transport, the stand-in) or cuda (every rank on the one GPU; rank 0 also runs
single mode there). OUT.json per run: rank 0's tokens, and per expert rank its rebalances,
weight moves, messages sent over the device path and whether every slot holds its logical
expert's checkpoint weights.
"""
import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))

from mpi4py import MPI  # noqa: E402

from abort_on_error import run_or_abort  # noqa: E402
from eplb_job import check_weights as weights_ok, run_and_gather  # noqa: E402
from runtime_job import CACHE, SCHED, inputs  # noqa: E402

from megainfer.config import (CommConfig, DeployPlan, DeviceConfig, EplbConfig, LoadConfig,  # noqa: E402
                              ModelConfig)
from megainfer.models import build_model  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402

EPLB = EplbConfig(enabled=True, redundant_experts=2, window=3, interval=3)
MAX_TOKENS = 12


def device_config(device: str) -> DeviceConfig:
    if device == "cpu":
        return DeviceConfig()
    return DeviceConfig(device="cuda", attention_backend="triton", cuda_graphs=False,
                        index=MPI.COMM_WORLD.Get_rank() % torch.cuda.device_count())


def single(cfg, ckpt, dev: DeviceConfig) -> dict:
    from megainfer.engine.engine import LLMEngine
    model = build_model(cfg, LoadConfig(path=ckpt), device=dev.torch_device)
    model.set_attention_backend(dev.attention_backend)
    eng = LLMEngine.from_model(model, SCHED, CACHE)
    return {o.request_id: o.outputs[0].token_ids
            for o in eng.generate_stream(inputs(cfg.vocab_size, MAX_TOKENS))}


def main():
    out, ckpt, device, moves = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    comm = MPI.COMM_WORLD
    cfg, load = ModelConfig.from_pretrained(ckpt), LoadConfig(path=ckpt)
    dev = device_config(device)
    if dev.device == "cuda":
        torch.cuda.set_device(dev.index)
    plan = DeployPlan(mode="disaggregated", expert_ranks=2, micro_batches=2)
    result = {}
    if comm.Get_rank() == 0 and dev.device == "cuda":
        result["single"] = single(cfg, ckpt, dev)
    def stats(r):
        reb = r.worker.rebalancer
        return {"rebalances": reb.rebalances, "moved": reb.moved,
                "device_messages": reb.device_messages, "kind": reb.moves,
                "weights_ok": weights_ok(r, cfg, load)}
    for choice in moves:
        job = ResolvedJob(cfg, load, SCHED, CACHE, plan, CommConfig(timeout_s=120, eplb_moves=choice),
                      EPLB, device=dev)
        tokens, experts = run_and_gather(job, cfg.vocab_size, MAX_TOKENS, stats)
        if comm.Get_rank() == 0:
            result[choice] = {"tokens": tokens, "experts": experts}
    if comm.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    run_or_abort(main)
