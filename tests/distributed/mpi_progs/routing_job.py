"""Disaggregated or colocated jobs with several attention replicas, every routing policy with
prefix caching off and on, in one mpiexec launch; rank 0 dumps tokens and routing counts.

    mpiexec -n K python routing_job.py OUT.json A E CKPT [max_tokens]
E = 0 runs colocated mode over the A ranks. The prompts are ``runtime_job.shared_inputs`` (12
requests over 3 system prompts, at most 40 tokens each) on a pool of 14 blocks of 4 per replica:
preemption and eviction forced; with caching on, a second tier (``cache.host_kv_gib``) too.
OUT.json maps "<routing>|caching=<0/1>" to {"tokens": {request id: token ids}, "cached":
prompt tokens served by the prefix cache, "assigned": requests per replica, "matched": blocks
the router found on the replica it chose, "preemptions" and "tier_loaded": rank 0's
replica's}.
"""
import dataclasses
import sys

import torch

torch.set_num_threads(1)

from abort_on_error import run_or_abort  # noqa: E402
from runtime_job import SCHED, SHARED_CACHE, dump_results, shared_inputs  # noqa: E402

from megainfer.config import CommConfig, DeployPlan, LoadConfig, ModelConfig  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402


def main():
    out, A, E, ckpt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    max_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 12
    cfg = ModelConfig.from_pretrained(ckpt)
    plan = DeployPlan(mode="disaggregated" if E else "colocated", attention_replicas=A,
                      attention_tp=1, expert_ranks=E, micro_batches=2)
    results = {}
    for routing in ("round_robin", "cache_aware"):
        for caching in (False, True):
            sched = dataclasses.replace(SCHED, routing=routing, max_model_len=48)
            cache = dataclasses.replace(SHARED_CACHE, enable_prefix_caching=caching,
                                        num_blocks=14, host_kv_gib=0.01 if caching else 0.0)
            r = build_rank(ResolvedJob(cfg, LoadConfig(path=ckpt), sched, cache, plan,
                                   CommConfig(timeout_s=120, transport="mpi")))
            stream = run_job(r, shared_inputs(cfg.vocab_size, max_tokens))
            if stream is not None:
                outs = list(stream)
                router = r.loop.router
                results[f"{routing}|caching={int(caching)}"] = dict(
                    tokens={o.request_id: o.outputs[0].token_ids for o in outs},
                    cached=sum(o.num_cached_tokens or 0 for o in outs),
                    assigned=router.assigned, matched=router.matched_blocks,
                    preemptions=r.loop.engine.num_preemptions,
                    tier_loaded=r.loop.engine.kv_tier.num_loaded if caching else 0)
            r.close()
    dump_results(out, results)


if __name__ == "__main__":
    run_or_abort(main)
