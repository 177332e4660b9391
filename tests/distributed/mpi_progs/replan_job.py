"""Re-planning under mpiexec: forced switches a1e3 -> a2e2 -> a1e3 while requests run.

    mpiexec -n 4 python replan_job.py OUT.json CKPT [RUNS] [q=FMT[,FMT...]]
RUNS (comma list, default move,recompute): the forced switches with a leaving replica's
requests keeping their KV (``move``) or recomputing it (``recompute``, with live EPLB every 3
iterations); ``n2``/``n2r``: as ``move``/``recompute`` with half the requests asking for 2 seeded
samples; ``m``: switches that change the micro-batch count too (``FORCE_M``); ``auto``:
measured decisions every 3 iterations, min_gain 0 (it switches whenever the refitted model
predicts any gain); ``hang``, ``hang_dup``, ``hang_channels``: rank 2 hangs in the first
switch, in the placement, before the communicator duplication or in the channels' rebuild (the
job must end naming it). Traces on. OUT.json per run: rank 0's tokens, its re-plan records and
decisions, the number of re-plan marks in its trace, and per switch per rank the role it took
and, on expert ranks, whether every slot holds its logical expert's checkpoint weights.
``q=FMT,...``: each run once per model.quantization (group size 32; ``none``: the checkpoint's
own), keyed "RUN|FMT" in OUT.json.
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
from megainfer.runtime.replan import runner as replan_runner  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402

SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
CACHE = CacheConfig(block_size=4, num_blocks=256)
FORCE = ((5, "a2e2"), (12, "a1e3"))
FORCE_M = ((4, "a1e3m3"), (8, "a2e2m1"), (13, "a1e3m2"))  # launched with 2 micro-batches
MAX_TOKENS = 14


def inputs(vocab: int, n2: bool = False):
    """12 prompts of 2..30 tokens; with 4 sequences a replica (+1 queued), some wait for the
    second replica the first switch starts. ``n2``: the odd ones ask for 2 seeded samples
    each (temperature 0.8), so such groups run on every replica across both switches."""
    g = torch.Generator().manual_seed(21)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lens = torch.randint(2, 31, (12,), generator=g).tolist()
    return [PromptInput(f"q{i}", params=SamplingParams(
                n=2, temperature=0.8, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
                if n2 and i % 2 else params,
                prompt_token_ids=torch.randint(3, vocab, (n,), generator=g).tolist())
            for i, n in enumerate(lens)]


def tokens_of(out) -> list:
    """A request's tokens: its one sample's, or every sample's (n > 1) in index order."""
    if len(out.outputs) == 1:
        return out.outputs[0].token_ids
    return [c.token_ids for c in sorted(out.outputs, key=lambda c: c.index)]


def load_config(ckpt: str, quantization=None) -> LoadConfig:
    return LoadConfig(path=ckpt, quantization=quantization, quantization_group_size=32)


def reference(ckpt: str, n2: bool = False, quantization=None) -> dict:
    """Single mode, same prompts (weights in ``quantization``): {request id: tokens}."""
    from megainfer.engine.engine import LLMEngine
    cfg = ModelConfig.from_pretrained(ckpt)
    eng = LLMEngine.from_model(build_model(cfg, load_config(ckpt, quantization)), SCHED, CACHE)
    return {o.request_id: tokens_of(o) for o in eng.generate_stream(inputs(cfg.vocab_size, n2))}


def main():
    out, ckpt = sys.argv[1], sys.argv[2]
    args = [a for a in sys.argv[3:] if not a.startswith("q=")]
    fmts = next((a[2:].split(",") for a in sys.argv[3:] if a.startswith("q=")), None)
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
            "auto": ReplanConfig(enabled=True, interval=3, min_gain=0.0),
            "n2": ReplanConfig(enabled=True, force_schedule=FORCE, kv_transfer="move"),
            "n2r": ReplanConfig(enabled=True, force_schedule=FORCE, kv_transfer="recompute"),
            "m": ReplanConfig(enabled=True, force_schedule=FORCE_M, kv_transfer="auto")}
    if args and args[0].startswith("hang"):  # rank 2 hangs inside the switch
        return hang(cfg, load, plan, args[0])
    runs_asked = [(mode, q) for mode in (args[0].split(",") if args else ("move", "recompute"))
                  for q in (fmts or [None])]
    for mode, q in runs_asked:
        key = mode if fmts is None else f"{mode}|{q}"
        load = load_config(ckpt, None if q in (None, "none") else q)
        checks.clear()
        replan = runs[mode]
        eplb = EplbConfig(enabled=True, redundant_experts=2, window=3, interval=3) \
            if mode == "recompute" else EplbConfig()  # live EPLB around the switches too
        r = build_rank(ResolvedJob(cfg, load, SCHED, CACHE, plan, CommConfig(timeout_s=120), eplb,
                               trace=TraceConfig(enabled=True), replan=replan))
        stream = run_job(r, inputs(cfg.vocab_size, n2=mode.startswith("n2")))
        tokens = {o.request_id: tokens_of(o) for o in stream} if stream else None
        final = (r.role.kind, weights_ok(r, cfg, load) if r.worker is not None else None,
                 r.worker.rebalancer.rebalances if r.worker is not None else 0)
        gathered = comm.gather((list(checks), final), root=0)
        if comm.Get_rank() == 0:
            marks = sum(1 for e in r.tracer.events if e["cat"] == "replan")
            result[key] = {"tokens": tokens, "records": r.replans, "marks": marks,
                            "decisions": r.replan_decisions,
                            "checks": [g[0] for g in gathered], "final": [g[1] for g in gathered]}
        r.close()
    if comm.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def hang(cfg, load, plan, where):
    """Rank 2 stops answering inside the switch: ``hang`` while computing the new placement,
    ``hang_dup`` just before the switch's communicator duplication, ``hang_channels`` while
    building the new channels (the others are inside the collective calls then). The others must
    end the job within comm.timeout_s (doubled in the switch), naming rank 2 and the phase."""
    import time

    from megainfer.runtime import wiring
    from megainfer.runtime.replan import switch as replan_switch
    if MPI.COMM_WORLD.Get_rank() == 2:
        if where == "hang_channels":  # the switch's channel set-up (start-up's is wiring's too)
            def hang_channels(*a, **k):
                wiring.make_m2n = lambda *a, **k: time.sleep(3600)
                return original_switch(*a, **k)
            original_switch = replan_runner.switch
            replan_runner.switch = hang_channels
        else:
            name = {"hang": "new_placement", "hang_dup": "assign_role"}[where]
            setattr(replan_switch, name, lambda *a, **k: time.sleep(3600))
    replan = ReplanConfig(enabled=True, force_schedule=FORCE[:1])
    r = build_rank(ResolvedJob(cfg, load, SCHED, CACHE, plan, CommConfig(timeout_s=2), replan=replan))
    stream = run_job(r, inputs(cfg.vocab_size))
    if stream is not None:
        list(stream)


if __name__ == "__main__":
    run_or_abort(main)
