"""The disaggregated runtime on one GPU shared by every rank: single mode's tokens first (rank 0,
in process), then disaggregated runs (rank 0 attention, the others expert ranks) for every
transport x dtype x micro-batch count, all in one launch.

    mpiexec -n K python gpu_runtime_job.py OUT_DIR CKPT TRANSPORTS DTYPES MS [trace|tp2]

Writes OUT_DIR/result.json: {"single|<dtype>": {rid: tokens}, "<transport>|<dtype>|m=<m>":
{rid: tokens}, "syncs|<transport>|<dtype>|m=<m>": [[seqs, tokens, host syncs] per step]}.
Host syncs: torch's synchronizing calls on rank 0 per engine step (set_sync_debug_mode), and
"expert_syncs|<run>": per expert rank [calls, synchronising calls] of its experts' forward and
load count over the run. With
``trace``, the last run is traced and every rank writes OUT_DIR/trace.rank<r>.json. With
``tp2``, ranks 0 and 1 are one attention replica with TP 2 (comm.tp_collectives=auto: point to
point over cuda_ipc when that is the transport); "tp_sent|<run>" counts rank 0's collectives
that went point to point.
"""
import json
import os
import sys
import warnings

import torch
from mpi4py import MPI

from abort_on_error import run_or_abort
from runtime_job import CACHE, SCHED, inputs

from megainfer.config import (CommConfig, DeployPlan, DeviceConfig, LoadConfig, ModelConfig,
                              TraceConfig)
from megainfer.engine.engine import LLMEngine
from megainfer.models import build_model
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank

WORLD = MPI.COMM_WORLD
MAX_TOKENS = 8


def device_config() -> DeviceConfig:
    return DeviceConfig(device="cuda", attention_backend="triton", cuda_graphs=False,
                        index=WORLD.Get_rank() % torch.cuda.device_count())


def single(cfg, ckpt, dtype) -> dict:
    dev = device_config()
    torch.cuda.set_device(dev.index)
    model = build_model(cfg, LoadConfig(path=ckpt, dtype=dtype), device=dev.torch_device)
    model.set_attention_backend(dev.attention_backend)
    eng = LLMEngine.from_model(model, SCHED, CACHE)
    return {o.request_id: o.outputs[0].token_ids
            for o in eng.generate_stream(inputs(cfg.vocab_size, MAX_TOKENS))}


def count_syncs(engine, log: list) -> None:
    """Wrap engine.step: record (seqs, tokens, synchronising calls) of each step."""
    step = engine.step

    def counted():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                out = step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        n = sum("synchroniz" in str(w.message) for w in caught)
        seqs, tokens, _ = engine.executor.step_log[-1] if engine.executor.step_log else (0, 0, 0)
        log.append([seqs, tokens, n])
        return out
    engine.step = counted


def count_expert_syncs(worker, tally: list) -> None:
    """Wrap an expert rank's compute (each MoE layer's experts and the load count): tally
    [calls, synchronising calls] over the run."""
    def counted(fn):
        def call(*a, **kw):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode(1)
                try:
                    return fn(*a, **kw)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                    tally[0] += 1
                    tally[1] += sum("synchroniz" in str(w.message) for w in caught)
        return call
    for layer in worker.model.layers:
        if layer.is_moe:
            layer.mlp.experts.forward = counted(layer.mlp.experts.forward)
    if worker.rebalancer is not None:
        worker.rebalancer.record = counted(worker.rebalancer.record)


def main():
    out_dir, ckpt = sys.argv[1], sys.argv[2]
    transports, dtypes = sys.argv[3].split(","), sys.argv[4].split(",")
    ms = [int(m) for m in sys.argv[5].split(",")]
    traced = len(sys.argv) > 6 and sys.argv[6] == "trace"
    tp = 2 if len(sys.argv) > 6 and sys.argv[6] == "tp2" else 1
    cfg = ModelConfig.from_pretrained(ckpt)
    me, E = WORLD.Get_rank(), WORLD.Get_size() - tp
    results = {}
    if me == 0:
        for dtype in dtypes:
            results[f"single|{dtype}"] = single(cfg, ckpt, dtype)
    WORLD.Barrier()
    runs = [(t, d, m) for t in transports for d in dtypes for m in ms]
    for i, (transport, dtype, m) in enumerate(runs):
        trace = traced and i == len(runs) - 1
        plan = DeployPlan(mode="disaggregated", attention_replicas=1, attention_tp=tp,
                          expert_ranks=E, micro_batches=m)
        job = ResolvedJob(cfg, LoadConfig(path=ckpt, dtype=dtype), SCHED, CACHE, plan,
                      CommConfig(timeout_s=60, transport=transport), trace=TraceConfig(enabled=trace),
                      device=device_config())
        r = build_rank(job)
        key = f"{transport}|{dtype}|m={m}"
        syncs, expert_syncs = [], [0, 0]
        if me == 0:
            count_syncs(r.loop.engine, syncs)
        if getattr(r, "worker", None) is not None:
            count_expert_syncs(r.worker, expert_syncs)
        stream = run_job(r, inputs(cfg.vocab_size, MAX_TOKENS))
        tallies = WORLD.gather(expert_syncs, root=0)
        if stream is not None:
            results[key] = {o.request_id: o.outputs[0].token_ids for o in stream}
            results[f"syncs|{key}"] = syncs
            results[f"expert_syncs|{key}"] = tallies[tp:]  # per expert rank: [calls, syncs]
            channel = r.tp.channel if r.tp is not None else None
            results[f"tp_sent|{key}"] = channel.sent if channel is not None else 0
        if trace:
            r.tracer.write(out_dir)
        WORLD.Barrier()
        r.close()
    if me == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    run_or_abort(main)
