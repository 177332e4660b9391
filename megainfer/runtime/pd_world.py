"""Build a rank of a job with prefill replicas (``deploy.prefill_replicas > 0``, docs/pd.md).

Rank order: decode attention ranks, expert ranks (as without prefill ranks), then the prefill
ranks. The decode attention ranks and expert ranks build exactly what they build without prefill
ranks, on a communicator of their own (``comm.Split``: same rank numbers, prefill ranks last),
and the attention ranks' loop becomes ``PDReplicaLoop``. A prefill rank builds the whole model
(experts local), an engine whose executor streams KV out (``PrefillExecutor``) and a
``PrefillWorker``. KV and the prefill messages travel on a duplicate of the world communicator.
"""
from __future__ import annotations

import dataclasses
import time

from megainfer.comm.wait import WaitPolicy
from megainfer.models import build_model

from .kv_stream import Dest, KVReceiver, KVSender, Segments, head_slice
from .pd_decode import DecodeSide
from .pd_loop import PDReplicaLoop
from .pd_router import PDRouter
from .prefill_worker import PrefillExecutor, PrefillWorker
from .roles import assign_role, prefill_rank_ids
from .trace import Tracer


def build_pd_rank(job, comm, build_rank):
    from .world import DTYPES, Rank, _engine
    plan, cfg = job.plan, job.model
    rank, world = comm.Get_rank(), comm.Get_size()
    role = assign_role(plan, rank, world)
    epoch = comm.bcast(time.perf_counter(), root=0)
    kv_comm = comm.Dup()
    core = comm.Split(1 if role.is_prefill else 0, rank)
    policy = WaitPolicy(mode=job.comm.wait_mode, timeout_s=job.comm.timeout_s)
    L, tp = cfg.num_layers, plan.attention_tp
    segs = Segments.for_job(job.sched.max_model_len, job.cache.block_size,
                            job.sched.max_num_batched_tokens)
    if role.is_prefill:
        dev = job.device.torch_device
        tracer = Tracer(enabled=job.trace.enabled, rank=rank, name=role.tag, epoch=epoch,
                        device=dev)
        model = build_model(cfg, job.load, role="full", device=dev)
        model.set_attention_backend(job.device.attention_backend)
        kind = model.kv_cache_spec(DTYPES[job.load.dtype]).kind
        dests = [[Dest(r * tp + t, head_slice(cfg.num_kv_heads, tp, t) if kind == "gqa" else None)
                  for t in range(tp)] for r in range(plan.attention_replicas)]
        sender = KVSender(kv_comm, L, kind, role.tag, policy, segs, job.cache.block_size)
        engine = _engine(job, role, model, lambda kv: PrefillExecutor(
            model, kv, job.cache.block_size, sender))
        track = (job.sched.routing == "cache_aware" and plan.prefill_replicas > 1
                 and job.cache.enable_prefix_caching)  # as rank 0's Router.tracks_keys
        worker = PrefillWorker(engine, engine.executor, kv_comm, dests, role.tag, policy, tracer,
                               track_keys=track)
        return Rank(role, tracer, worker=worker)
    r = build_rank(dataclasses.replace(job, plan=dataclasses.replace(plan, prefill_replicas=0)),
                   core)
    if r.loop is not None:
        lp, e = r.loop, r.loop.engine
        kv0 = e.kv_caches[0]
        receiver = KVReceiver(kv_comm, e.kv_spec.kind, tuple(kv0.shape), kv0.dtype, L, lp.role.tag,
                              policy, segs, e.kv_spec.parts)
        decode = DecodeSide(e, receiver, r.tracer if job.trace.enabled else None)
        router = PDRouter(kv_comm, prefill_rank_ids(plan), plan.attention_replicas, e,
                          lp.role.tag, policy) if rank == 0 else None
        r.loop = PDReplicaLoop(e, lp.role, lp.plan, lp.control, lp.exchange, lp.first_moe_layer,
                               decode, router)
    return r
