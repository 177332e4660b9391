"""Disaggregated jobs with prefill replicas in one mpiexec launch; rank 0 dumps outputs.

    mpiexec -n K python pd_job.py OUT.json A TP E P MS CKPT[,CKPT...] [key=value ...]
keys: ``max_tokens`` (12), ``fault`` (kill | hang), ``kv`` (cache.kv_cache_dtype, auto),
``blocks`` (cache.num_blocks of every engine, runtime_job's by default: a small pool makes the
decode replica wait to reserve, and preempt), ``prompts=shared`` (``runtime_job.shared_inputs``
with prefix caching on, ``SHARED_CACHE``'s block size), ``routing`` (scheduler.routing).
A decode attention replicas x TP, E expert ranks, P prefill ranks (K = A*TP + E + P); MS a
comma list of micro-batch counts. Prompts and configs are ``runtime_job``'s, so the single-mode
reference is the same. ``fault=kill``: every prefill rank kills itself (SIGKILL) at its first step
(the process manager ends the job); ``fault=hang``: it stops answering instead (sleeps), so rank 0 must
notice within comm.timeout_s (3 s here) and abort the job naming it. Both with comm.timeout_s=3.
OUT.json maps "<ckpt>|m=<m>" to {request id: token ids}, and "<ckpt>|m=<m>|stats" to rank 0's
counts (requests handed to each decode replica and prefilled by each prefill rank, the KV
handoff times seen).
"""
import dataclasses
import json
import os
import signal
import sys
import time

import torch

torch.set_num_threads(1)

from abort_on_error import run_or_abort  # noqa: E402
from runtime_job import CACHE, SCHED, SHARED_CACHE, inputs, shared_inputs  # noqa: E402

from megainfer.config import CommConfig, DeployPlan, LoadConfig, ModelConfig  # noqa: E402
from megainfer.runtime.prefill_worker import PrefillWorker  # noqa: E402
from megainfer.runtime.world import JobSpec, build_rank, run_rank  # noqa: E402


def _die_at_first_step(self):
    os.kill(os.getpid(), signal.SIGKILL)


def _hang_at_first_step(self):
    time.sleep(3600)


def main():
    out, A, TP, E, P = sys.argv[1], *map(int, sys.argv[2:6])
    ms = [int(m) for m in sys.argv[6].split(",")]
    ckpts = sys.argv[7].split(",")
    opts = dict(a.split("=", 1) for a in sys.argv[8:])
    max_tokens, fault = int(opts.get("max_tokens", 12)), opts.get("fault")
    shared = opts.get("prompts") == "shared"
    make_inputs, base = (shared_inputs, SHARED_CACHE) if shared else (inputs, CACHE)
    cache = dataclasses.replace(base, kv_cache_dtype=opts.get("kv", "auto"),
                                num_blocks=int(opts.get("blocks", CACHE.num_blocks)))
    sched = dataclasses.replace(SCHED, routing=opts.get("routing", SCHED.routing))
    kill = fault in ("kill", "hang")
    if kill:
        PrefillWorker._step = _die_at_first_step if fault == "kill" else _hang_at_first_step
    results = {}
    for ckpt in ckpts:
        cfg = ModelConfig.from_pretrained(ckpt)
        for m in ms:
            plan = DeployPlan(mode="disaggregated", attention_replicas=A, attention_tp=TP,
                              expert_ranks=E, micro_batches=m, prefill_replicas=P)
            r = build_rank(JobSpec(cfg, LoadConfig(path=ckpt), sched, cache, plan,
                                   CommConfig(timeout_s=3 if kill else 120, transport="mpi")))
            stream = run_rank(r, make_inputs(cfg.vocab_size, max_tokens))
            if stream is not None:
                outs = list(stream)
                results[f"{ckpt}|m={m}"] = {o.request_id: o.outputs[0].token_ids for o in outs}
                results[f"{ckpt}|m={m}|stats"] = dict(
                    assigned=r.loop.pd.assigned, prefilled=r.loop.pd.prefilled,
                    handoffs=sum(o.metrics.kv_handoff_s is not None for o in outs),
                    preemptions=r.loop.engine.num_preemptions,
                    cached=sum(o.num_cached_tokens or 0 for o in outs))
            r.close()
    if results:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    run_or_abort(main)
