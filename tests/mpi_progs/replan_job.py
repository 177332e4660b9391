"""Re-planning under mpiexec: forced switches a1e3 -> a2e2 -> a1e3 while requests run.

    mpiexec -n 4 python replan_job.py OUT.json CKPT [RUNS]
RUNS (comma list, default move,recompute): the forced switches with a leaving replica's
requests keeping their KV (``move``) or recomputing it (``recompute``, with live EPLB every 3
iterations); ``auto``: measured decisions every 3 iterations, min_gain 0 (it switches whenever
the refitted model predicts any gain); ``hang``: rank 2 hangs in the first switch (the job must
end naming it). Traces on. OUT.json per run: rank 0's tokens, its re-plan records and
decisions, the number of re-plan marks in its trace, and per switch per rank the role it took
and, on expert ranks, whether every slot holds its logical expert's checkpoint weights.
"""
import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))

from mpi4py import MPI  # noqa: E402

from abort_on_error import run_or_abort  # noqa: E402
from eplb_job import check_weights as weights_ok  # noqa: E402

from megainfer.config import (CacheConfig, CommConfig, DeployPlan, EplbConfig, LoadConfig,  # noqa: E402
                              ModelConfig, ReplanConfig, SchedulerConfig, TraceConfig)
from megainfer.engine.outputs import PromptInput  # noqa: E402
from megainfer.engine.sampling_params import SamplingParams  # noqa: E402
from megainfer.models import build_model  # noqa: E402
from megainfer.runtime import replan_runner  # noqa: E402
from megainfer.runtime.world import JobSpec, build_rank, run_rank  # noqa: E402

SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
CACHE = CacheConfig(block_size=4, num_blocks=256)
FORCE = ((5, "a2e2"), (12, "a1e3"))
MAX_TOKENS = 14


def inputs(vocab: int):
    """12 prompts of 2..30 tokens; with 4 sequences a replica (+1 queued), some wait for the
    second replica the first switch starts."""
    g = torch.Generator().manual_seed(21)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lens = torch.randint(2, 31, (12,), generator=g).tolist()
    return [PromptInput(f"q{i}", params=params,
                        prompt_token_ids=torch.randint(3, vocab, (n,), generator=g).tolist())
            for i, n in enumerate(lens)]


def reference(ckpt: str) -> dict:
    """Single mode, same prompts: {request id: greedy tokens}."""
    from megainfer.engine.engine import LLMEngine
    cfg = ModelConfig.from_pretrained(ckpt)
    eng = LLMEngine.from_model(build_model(cfg, LoadConfig(path=ckpt)), SCHED, CACHE)
    return {o.request_id: o.outputs[0].token_ids for o in eng.generate_stream(inputs(cfg.vocab_size))}


def main():
    out, ckpt = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    cfg, load = ModelConfig.from_pretrained(ckpt), LoadConfig(path=ckpt)
    plan = DeployPlan(mode="disaggregated", attention_replicas=1, expert_ranks=3, micro_batches=2)
    checks = []
    original = replan_runner.switch

    def checked_switch(r, order):  # the real switch, then what this rank became
        rec = original(r, order)
        checks.append((r.role.kind, weights_ok(r, cfg, load) if r.worker is not None else None))
        return rec
    replan_runner.switch = checked_switch
    result = {}
    runs = {"move": ReplanConfig(enabled=True, force_schedule=FORCE, kv_transfer="move"),
            "recompute": ReplanConfig(enabled=True, force_schedule=FORCE, kv_transfer="recompute"),
            "auto": ReplanConfig(enabled=True, interval=3, min_gain=0.0)}
    if len(sys.argv) > 3 and sys.argv[3] == "hang":  # expert rank 2 hangs inside the switch
        return hang(cfg, load, plan)
    for mode in sys.argv[3].split(",") if len(sys.argv) > 3 else ("move", "recompute"):
        checks.clear()
        replan = runs[mode]
        eplb = EplbConfig(enabled=True, redundant_experts=2, window=3, interval=3) \
            if mode == "recompute" else EplbConfig()  # live EPLB around the switches too
        r = build_rank(JobSpec(cfg, load, SCHED, CACHE, plan, CommConfig(timeout_s=120), eplb,
                               trace=TraceConfig(enabled=True), replan=replan))
        stream = run_rank(r, inputs(cfg.vocab_size))
        tokens = {o.request_id: o.outputs[0].token_ids for o in stream} if stream else None
        final = (r.role.kind, weights_ok(r, cfg, load) if r.worker is not None else None,
                 r.worker.rebalancer.rebalances if r.worker is not None else 0)
        gathered = comm.gather((list(checks), final), root=0)
        if comm.Get_rank() == 0:
            marks = sum(1 for e in r.tracer.events if e["cat"] == "replan")
            result[mode] = {"tokens": tokens, "records": r.parts["replans"], "marks": marks,
                            "decisions": r.parts["replan_decisions"],
                            "checks": [g[0] for g in gathered], "final": [g[1] for g in gathered]}
        r.close()
    if comm.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def hang(cfg, load, plan):
    """Rank 2 stops answering while computing the new placement: the others must end the job
    within comm.timeout_s (doubled in the switch), naming rank 2 and the phase."""
    import time

    from megainfer.runtime import replan_switch
    if MPI.COMM_WORLD.Get_rank() == 2:
        replan_switch.new_placement = lambda *a, **k: time.sleep(3600)
    replan = ReplanConfig(enabled=True, force_schedule=FORCE[:1])
    r = build_rank(JobSpec(cfg, load, SCHED, CACHE, plan, CommConfig(timeout_s=2), replan=replan))
    stream = run_rank(r, inputs(cfg.vocab_size))
    if stream is not None:
        list(stream)


if __name__ == "__main__":
    run_or_abort(main)
