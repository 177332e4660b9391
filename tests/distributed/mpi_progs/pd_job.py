"""Disaggregated jobs with prefill replicas in one mpiexec launch; rank 0 dumps outputs.

    mpiexec -n K python pd_job.py OUT.json A TP E P MS CKPT[,CKPT...] [key=value ...]
keys: ``max_tokens`` (12), ``fault`` (kill | hang | hang_peer | hang_offload), ``kv`` (cache.kv_cache_dtype, auto),
``blocks`` (cache.num_blocks of every engine, runtime_job's by default: a small pool makes the
decode replica wait to reserve, and preempt), ``prompts=shared`` (``runtime_job.shared_inputs``
with prefix caching on, ``SHARED_CACHE``'s block size), ``routing`` (scheduler.routing),
``ptp`` (deploy.prefill_tp, 1: P is then prefill replicas of ``ptp`` ranks each), ``tp``
(comm.tp_collectives, auto), ``prefill_delay`` (seconds every prefill step sleeps first), ``n``
(``sampled_inputs``: seeded sampling with that many samples per request; OUT.json then maps
each request to its samples' token ids), ``q`` (model.quantization, group size 32), ``offload``
(a comma list of pd.offload_ratio values or ``auto``, pd.offload_policy=auto: each runs with
pd.offload=true, keyed "<ckpt>|m=<m>|off=<ratio or auto>", its stats adding the offload
counts of every rank), ``pool``
(pd.offload_blocks), ``mml`` (scheduler.max_model_len, 128), ``seqs`` (scheduler.max_num_seqs,
8: fewer hand rank 0's requests out as seats free, so later ones meet earlier ones decoding),
``first`` (max_tokens of the first request, ``max_tokens`` by default).
A decode attention replicas x TP, E expert ranks, P prefill replicas (K = A*TP + E + P*ptp); MS a
comma list of micro-batch counts. Prompts and configs are ``runtime_job``'s, so the single-mode
reference is the same. ``fault=kill``: every prefill rank kills itself (SIGKILL) at its first step
(the process manager ends the job); ``fault=hang``: it stops answering instead (sleeps), so rank 0 must
notice within comm.timeout_s (3 s here) and abort the job naming it; ``fault=hang_peer``: only
the prefill TP ranks other than a replica's leader sleep at their first step (the leader's
all-reduce waits for them); ``fault=hang_offload``: a prefill rank sleeps at the first
offloaded attention it is asked for (the decode rank waiting for it must name it). All with comm.timeout_s=3.
OUT.json maps "<ckpt>|m=<m>" to {request id: token ids}, and "<ckpt>|m=<m>|stats" to rank 0's
counts (requests handed to each decode replica and prefilled by each prefill rank, the KV
handoff times seen, per rank the TP collectives that went point to point, rank 0's idle
counts ``PDReplicaLoop.idle`` and the prefill reports it received).
"""
import dataclasses
import os
import signal
import sys
import time

import torch

torch.set_num_threads(1)

from abort_on_error import run_or_abort  # noqa: E402
from runtime_job import CACHE, SCHED, SHARED_CACHE, dump_results, inputs, shared_inputs  # noqa: E402

from mpi4py import MPI  # noqa: E402

from megainfer.config import CommConfig, DeployPlan, LoadConfig, ModelConfig, PdConfig  # noqa: E402
from megainfer.runtime.pd.offload_pool import OffloadPool  # noqa: E402
from megainfer.runtime.pd.prefill_worker import PrefillWorker  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402


def sampled_inputs(vocab: int, max_tokens: int, n: int):
    """runtime_job's prompts, sampled (temperature 0.8, top-k 20, a seed per request), ``n``
    samples each. r3 (max_tokens=1) finishes every sample at its first token; r5 stops at every
    third token id: with its seed (for the tiny Mixtral of the tests), sample 0 (the group's
    head) finishes at its first token while the others go on."""
    from megainfer.engine.outputs import PromptInput
    from megainfer.engine.sampling_params import SamplingParams
    from runtime_job import prompts
    out = []
    for i, p in enumerate(prompts(vocab)):
        params = SamplingParams(temperature=0.8, top_k=20, seed=104 if i == 5 else 100 + i, n=n,
                                ignore_eos=True, max_tokens=1 if i == 3 else max_tokens - (i % 3),
                                stop_token_ids=list(range(3, vocab, 3)) if i == 5 else None)
        out.append(PromptInput(f"r{i}", prompt_token_ids=p, params=params))
    return out


def _die_at_first_step(self):
    os.kill(os.getpid(), signal.SIGKILL)


def _hang_at_first_step(self):
    time.sleep(3600)


def _hang_unless_leader(step):
    def hang_peer(self):
        if not self.leader:
            time.sleep(3600)
        return step(self)
    return hang_peer


def _delayed(step, seconds: float):
    def slow(self):
        time.sleep(seconds)
        return step(self)
    return slow


def offload_counts(r) -> dict:
    """This rank's pd.offload counts: a prefill rank's pool (requests kept, messages served,
    blocks still held), a decode rank's client (requests started offloaded, still offloaded,
    per-layer round trips) and its engine's free blocks."""
    worker = getattr(r, "worker", None)
    pool = getattr(getattr(worker, "executor", None), "offload", None)
    if pool is not None:
        return dict(kept=pool.kept, served=pool.served, held=len(pool.held),
                    free=pool.blocks.num_free_blocks, blocks=pool.num_blocks,
                    home=pool.home.returned)
    loop = getattr(r, "loop", None)
    client = getattr(getattr(loop, "decode", None), "offload", None)
    if client is None:
        return {}
    b = loop.engine.blocks
    out = dict(started=client.started, offloaded=client.num_offloaded, returned=client.returned,
               homed=client.homed, trips=client.trips.count, free=b.num_free_blocks,
               blocks=b.num_blocks)
    if loop.pd is not None:
        out["chosen"] = loop.pd.offload.offloaded
        out["sent_home"] = loop.pd.offload.sent_home
        out["busy_s"] = [q[-1][1] if q else 0.0 for q in loop.pd.offload.busy]  # as reported
    return out


def main():
    out, A, TP, E, P = sys.argv[1], *map(int, sys.argv[2:6])
    ms = [int(m) for m in sys.argv[6].split(",")]
    ckpts = sys.argv[7].split(",")
    opts = dict(a.split("=", 1) for a in sys.argv[8:])
    max_tokens, fault = int(opts.get("max_tokens", 12)), opts.get("fault")
    shared = opts.get("prompts") == "shared"
    make_inputs, base = (shared_inputs, SHARED_CACHE) if shared else (inputs, CACHE)
    ptp, n = int(opts.get("ptp", 1)), int(opts.get("n", 0))
    if n:
        make_inputs = lambda vocab, mt: sampled_inputs(vocab, mt, n)  # noqa: E731
    if "first" in opts:  # the first request decodes longer
        make_inputs = lambda vocab, mt: inputs(vocab, mt, int(opts["first"]))  # noqa: E731
    cache = dataclasses.replace(base, kv_cache_dtype=opts.get("kv", "auto"),
                                num_blocks=int(opts.get("blocks", CACHE.num_blocks)),
                                kv_scale_granularity=opts.get("gran", base.kv_scale_granularity))
    sched = dataclasses.replace(SCHED, routing=opts.get("routing", SCHED.routing),
                                max_model_len=int(opts.get("mml", SCHED.max_model_len)),
                                max_num_seqs=int(opts.get("seqs", SCHED.max_num_seqs)))
    kill = fault in ("kill", "hang", "hang_peer", "hang_offload")  # comm.timeout_s=3
    if fault == "hang_offload":  # the prefill rank stops answering at its first offload message
        OffloadPool._attend = lambda self, msg: time.sleep(3600)
    if "prefill_delay" in opts:  # a slow prefill: the decode pool has long idle stretches
        PrefillWorker._step = _delayed(PrefillWorker._step, float(opts["prefill_delay"]))
    if fault == "hang_peer":  # TP rank 1 of a prefill replica sleeps at its first step
        PrefillWorker._step = _hang_unless_leader(PrefillWorker._step)
    elif kill and fault != "hang_offload":
        PrefillWorker._step = _die_at_first_step if fault == "kill" else _hang_at_first_step
    results = {}
    # pd.offload_ratio values, or "auto" (pd.offload_policy=auto)
    ratios = [x if x == "auto" else float(x) for x in opts["offload"].split(",")] if "offload" in opts else [None]
    runs = [(m, ratio) for m in ms for ratio in ratios]
    for ckpt in ckpts:
        cfg = ModelConfig.from_pretrained(ckpt)
        for m, ratio in runs:
            key = (f"{ckpt}|m={m}" if ratio is None else f"{ckpt}|m={m}|off=auto" if ratio == "auto"
                   else f"{ckpt}|m={m}|off={ratio:g}")
            pool = int(opts["pool"]) if "pool" in opts else None
            pd = (PdConfig() if ratio is None else
                  PdConfig(offload=True, offload_policy="auto", offload_blocks=pool) if ratio == "auto" else
                  PdConfig(offload=True, offload_ratio=ratio, offload_blocks=pool))
            plan = DeployPlan(mode="disaggregated", attention_replicas=A, attention_tp=TP,
                              expert_ranks=E, micro_batches=m, prefill_replicas=P,
                              prefill_tp=ptp)
            comm = CommConfig(timeout_s=3 if kill else 120, transport="mpi",
                              tp_collectives=opts.get("tp", "auto"))
            load = LoadConfig(path=ckpt, quantization=opts.get("q"), quantization_group_size=32)
            r = build_rank(ResolvedJob(cfg, load, sched, cache, plan, comm, pd=pd))
            stream = run_job(r, make_inputs(cfg.vocab_size, max_tokens))
            outs = list(stream) if stream is not None else None  # rank 0: the job runs here
            group = r.tp
            tp_sent = MPI.COMM_WORLD.gather(  # per rank: TP collectives that went point to point
                group.channel.sent if group is not None and group.channel is not None else 0)
            off = offload_counts(r) if ratio is not None else None
            offs = MPI.COMM_WORLD.gather(off)
            if outs is not None:
                results[key] = {
                    o.request_id: [c.token_ids for c in o.outputs] if n else o.outputs[0].token_ids
                    for o in outs}
                results[f"{key}|stats"] = dict(offload=offs,
                    assigned=r.loop.pd.assigned, prefilled=r.loop.pd.prefilled,
                    handoffs=sum(o.metrics.kv_handoff_s is not None for o in outs),
                    preemptions=r.loop.engine.num_preemptions,
                    cached=sum(o.num_cached_tokens or 0 for o in outs), tp_sent=tp_sent,
                    idle=r.loop.idle, reports=r.loop.pd.reports)
            r.close()
    dump_results(out, results)


if __name__ == "__main__":
    run_or_abort(main)
