"""Re-planning with the expert weight moves device to device (comm.eplb_moves=device; on CPU over
the MPI transport): the forced switches of replan_job.py (a1e3 -> a2e2 -> a1e3, requests
recomputed, live EPLB every 3 iterations in between).

    mpiexec -n 4 python replan_device_job.py OUT.json CKPT
OUT.json: rank 0's tokens and re-plan records, per switch per rank the role it took and whether
every expert slot holds its logical expert's checkpoint weights, and per rank the messages the
device path sent, by phase ("re-plan expert weight move", "EPLB weight move").
"""
import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))

from mpi4py import MPI  # noqa: E402

from abort_on_error import run_or_abort  # noqa: E402
from replan_job import CACHE, FORCE, SCHED, inputs, tokens_of, weights_ok  # noqa: E402

from megainfer.config import (CommConfig, DeployPlan, EplbConfig, LoadConfig, ModelConfig,  # noqa: E402
                              ReplanConfig)
from megainfer.runtime.eplb import weight_channel  # noqa: E402
from megainfer.runtime.replan import runner as replan_runner  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402


def main():
    out, ckpt = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    cfg, load = ModelConfig.from_pretrained(ckpt), LoadConfig(path=ckpt)
    plan = DeployPlan(mode="disaggregated", attention_replicas=1, expert_ranks=3, micro_batches=2)
    checks, sent = [], {}
    original_switch, original_exchange = replan_runner.switch, weight_channel.WeightChannel.exchange

    def checked_switch(r, order):  # the real switch, then what this rank became
        rec = original_switch(r, order)
        checks.append((r.role.kind, weights_ok(r, cfg, load) if r.worker is not None else None))
        return rec

    def counted_exchange(self, outs, ins):  # the real exchange; its messages, by phase
        before = self.sent
        original_exchange(self, outs, ins)
        sent[self.what] = sent.get(self.what, 0) + self.sent - before
    replan_runner.switch = checked_switch
    weight_channel.WeightChannel.exchange = counted_exchange
    replan = ReplanConfig(enabled=True, force_schedule=FORCE, kv_transfer="recompute")
    eplb = EplbConfig(enabled=True, redundant_experts=2, window=3, interval=3)
    r = build_rank(ResolvedJob(cfg, load, SCHED, CACHE, plan,
                           CommConfig(timeout_s=120, eplb_moves="device"), eplb, replan=replan))
    stream = run_job(r, inputs(cfg.vocab_size))
    tokens = {o.request_id: tokens_of(o) for o in stream} if stream else None
    final = (r.role.kind, weights_ok(r, cfg, load) if r.worker is not None else None,
             r.worker.rebalancer.rebalances if r.worker is not None else 0)
    gathered = comm.gather((checks, final, sent), root=0)
    if comm.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"tokens": tokens, "records": r.replans,
                       "checks": [g[0] for g in gathered], "final": [g[1] for g in gathered],
                       "sent": [g[2] for g in gathered]}, f)
    r.close()


if __name__ == "__main__":
    run_or_abort(main)
