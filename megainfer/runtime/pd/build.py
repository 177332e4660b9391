"""Build a rank of a job with prefill replicas (``deploy.prefill_replicas > 0``, docs/pd.md).

Rank order: decode attention ranks, expert ranks (as without prefill ranks), then the prefill
ranks. The decode attention ranks and expert ranks build exactly what they build without prefill
ranks, on a communicator of their own (``comm.Split``: same rank numbers, prefill ranks last),
and the attention ranks' loop becomes ``PDReplicaLoop``. A prefill replica is
``deploy.prefill_tp`` consecutive ranks; each builds the whole model (attention split over the
replica's TP ranks, experts split over them), an engine whose executor streams its KV heads out
(``PrefillExecutor``, routes from ``kv_routes``) and a ``PrefillWorker``. KV and the prefill
messages travel on a duplicate of the world communicator.
"""
from __future__ import annotations

import dataclasses
import logging

from megainfer.config import ConfigError, PdConfig
from megainfer.config.pd import offload_needs
from megainfer.models import ParallelContext, build_model
from megainfer.models.kv_spec import kv_head_slice
from megainfer.runtime.pd.decode import DecodeSide
from megainfer.runtime.pd.kv_place import sender_scales
from megainfer.runtime.pd.kv_routes import check_prefill_tp, routes_to
from megainfer.runtime.pd.kv_segments import Segments
from megainfer.runtime.pd.kv_stream import Dest, KVReceiver, KVSender
from megainfer.runtime.pd.loop import PDReplicaLoop
from megainfer.runtime.pd.offload_decode import install_decode
from megainfer.runtime.pd.offload_policy import OffloadLedger
from megainfer.runtime.pd.offload_pool import OffloadPool
from megainfer.runtime.pd.offload_report import OffloadTally
from megainfer.runtime.pd.prefill_experts import expert_slots_of, split_experts
from megainfer.runtime.pd.prefill_worker import PrefillExecutor, PrefillWorker
from megainfer.runtime.pd.router import PDRouter
from megainfer.runtime.rank_parts import Feature, make_engine
from megainfer.runtime.replicas.request_router import tracks_keys
from megainfer.runtime.roles import assign_role, attention_rank, prefill_rank_ids
from megainfer.runtime.trace import Tracer
from megainfer.runtime.wiring import (build_base_rank, rank_of, replica_tp_group, trace_epoch,
                                      wait_policy, wire_rank)

log = logging.getLogger("megainfer.runtime")


def build_pd_rank(job, comm):
    plan, cfg = job.deploy, job.model
    rank, world = comm.Get_rank(), comm.Get_size()
    role = assign_role(plan, rank, world)
    why = check_prefill_tp(cfg.num_heads, cfg.num_kv_heads, cfg.is_mla, plan.prefill_tp,
                           cfg.num_experts)
    if why is not None:  # every rank raises the same, before any collective call
        raise ConfigError(f"deploy.prefill_tp={plan.prefill_tp}: {why}")
    check_offload(job)
    epoch = trace_epoch(comm)
    kv_comm = comm.Dup()
    core = comm.Split(1 if role.is_prefill else 0, rank)
    policy = wait_policy(job, role)  # the KV streams' and the hand-out's
    segs = Segments.for_job(job.scheduler.max_model_len, job.cache.block_size,
                            job.scheduler.max_num_batched_tokens)
    if role.is_prefill:
        return _build_prefill(job, role, core, kv_comm, segs, epoch)

    def decode_loop(r, engine, exchange, first_moe_layer):
        """A decode replica's loop: receives KV from the prefill ranks (docs/pd.md)."""
        kv0 = engine.kv_caches[0]
        receiver = KVReceiver(kv_comm, engine.kv_spec.kind, tuple(kv0.shape), kv0.dtype,
                              cfg.num_layers, r.role.label, policy, segs, engine.kv_spec.parts,
                              scaled=sender_scales(kv0) is not None)
        rts = routes_to(engine.kv_spec.kind, cfg.num_kv_heads, plan.prefill_tp, plan.attention_tp,
                        r.role.tp_rank)
        decode = DecodeSide(engine, receiver, r.tracer if job.trace.enabled else None,
                            lambda leader: [(leader + x.src, x.count) for x in rts])
        router = PDRouter(kv_comm, prefill_rank_ids(plan), plan.attention_replicas, engine,
                          r.role.label, policy) if rank == 0 else None
        if job.pd.offload:  # decode attention offloaded to the prefill ranks (offload_*.py)
            t = r.role.tp_rank  # prefill TP = decode TP: its peer; prefill TP 1: its heads there
            decode.offload = install_decode(engine, kv_comm, r.role.label, policy,
                                            offset=t if plan.prefill_tp > 1 else 0,
                                            part=t if plan.prefill_tp == 1 else 0)
            if router is not None:
                router.offload = OffloadLedger(
                    job.pd.offload_ratio, job.pd.pool_blocks(job.cache.num_blocks),
                    plan.prefill_replicas, job.cache.block_size, job.scheduler.max_model_len,
                    job.pd.offload_policy, plan.attention_replicas,
                    job.cache.num_blocks * job.cache.block_size, job.pd.offload_return_home,
                    job.slo.tpot_ms / 1e3, cfg.num_layers, job.pd.offload_max_prefill_busy)
        return PDReplicaLoop(engine, r.role, r.job.deploy, r.control, exchange, first_moe_layer,
                             decode, router,
                             OffloadTally() if job.pd.offload and router is not None else None)
    return build_base_rank(dataclasses.replace(job, pd=PdConfig(), deploy=dataclasses.replace(
        plan, prefill_replicas=0)), core, make_loop=decode_loop)


def check_offload(job) -> None:
    """``pd.offload`` where it is built (every rank raises the same, before any collective)."""
    pd, plan, cfg = job.pd, job.deploy, job.model
    if not pd.offload:
        return
    need = offload_needs(plan.prefill_tp, plan.attention_tp, cfg.is_mla, job.cache.kv_cache_dtype)
    if need:
        raise ConfigError(f"pd.offload=true: needs {need}")
    pool = pd.pool_blocks(job.cache.num_blocks)
    if pool >= job.cache.num_blocks:
        raise ConfigError(f"pd.offload_blocks={pool}: must leave blocks of the prefill rank's "
                          f"cache.num_blocks={job.cache.num_blocks} for prompts")


def _build_prefill(job, role, core, kv_comm, segs, epoch):
    """One TP rank of a prefill replica: the whole model (attention split over the replica's
    TP ranks as a decode replica's, the routed experts split over them too (``prefill_experts``),
    every other weight on every rank), its engine (identical on every TP rank: they get the same
    work at the same iteration), and the KV routes from this rank's heads to every decode TP
    rank."""
    plan, cfg, rank = job.deploy, job.model, role.rank
    tp, tp_rank, label = plan.prefill_tp, role.tp_rank, role.label
    w = wire_rank(job, core, role)  # this prefill replica's TP ranks
    par, slots, group = ParallelContext(), None, None
    if tp > 1:  # collectives over MPI, or the device transport (comm.tp_collectives)
        group = replica_tp_group(job, w, role)
        par = ParallelContext(tp_rank, tp, group.all_reduce)
        slots = [expert_slots_of(cfg.num_experts, tp, tp_rank)] * cfg.num_layers
    dev = job.device.torch_device
    tracer = Tracer(enabled=job.trace.enabled, rank=rank, name=label, epoch=epoch, device=dev)
    model = build_model(cfg, job.load, par, role="full", expert_slots=slots, device=dev)
    if tp > 1:
        split_experts(model, group.all_reduce)  # this rank's experts, partial sums all-reduced
    model.set_attention_backend(job.device.attention_backend)
    kind = model.kv_cache_spec(job.load.torch_dtype).kind
    dests = []  # per decode replica: what this rank sends to which of its TP ranks
    for r in range(plan.attention_replicas):
        dests.append([Dest(attention_rank(plan, r, t), x.sender_heads(cfg.num_kv_heads, tp))
                      for t in range(plan.attention_tp)
                      for x in routes_to(kind, cfg.num_kv_heads, tp, plan.attention_tp, t)
                      if x.src == tp_rank])
    sender = KVSender(kv_comm, cfg.num_layers, kind, label, w.policy, segs, job.cache.block_size)
    pool = job.pd.pool_blocks(job.cache.num_blocks)  # pd.offload: the cache split in two
    ejob = job if not pool else dataclasses.replace(job, cache=dataclasses.replace(
        job.cache, num_blocks=job.cache.num_blocks - pool))
    engine = make_engine(ejob, role, model, lambda kv: PrefillExecutor(
        model, kv, job.cache.block_size, sender))
    if pool:
        slices = None  # prefill TP 1: one head slice per decode TP rank (their split)
        if tp == 1 and plan.attention_tp > 1 and not cfg.is_mla:
            slices = [kv_head_slice(cfg.num_kv_heads, plan.attention_tp, t)
                      for t in range(plan.attention_tp)]
        engine.executor.offload = OffloadPool(engine, model, pool, kv_comm, label, w.policy, segs,
                                              slices)
        log.info("%s KV cache split: %d blocks for prompts in flight, %d for offloaded "
                 "requests (%.1f MiB)", label, ejob.cache.num_blocks, pool,
                 engine.executor.offload.nbytes() / 2**20)
    track = tracks_keys(job.scheduler.routing, plan.prefill_replicas, job.cache.enable_prefix_caching)
    worker = PrefillWorker(engine, engine.executor, kv_comm, dests, label, w.policy, tracer,
                           track_keys=track and tp_rank == 0,
                           peers=w.tp_comm if tp > 1 else None)
    out = rank_of(job, core, role, w, tracer)
    out.tp, out.worker = group, worker
    return out


PD = Feature("pd", wants=lambda job: job.deploy.prefill_replicas > 0, build=build_pd_rank)
