"""Wire one rank of a distributed job to the others, and build its base part.

``wire_rank`` is the one place a rank's connections are made (start-up, a prefill replica in
``pd/build.py``, a re-plan's rebuild in ``replan/switch.py``), collectively and in the same order
on every rank: the wait policy, both M2N channels, the TP and side communicators, the control
plane and the closers. ``build_base_rank`` is the base start-up by mode (disaggregated:
attention ranks with the ping-pong pipeline, expert ranks serving their slots; colocated: every
rank a full model with its expert slice); the parts come from ``rank_parts``. Features never
patch this module: they plug in through a ``Feature`` that ``startup.py`` picks.
docs/architecture.md, "Runtime rooms".
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from mpi4py import MPI

from megainfer.comm import M2N
from megainfer.comm.wait import WaitPolicy
from megainfer.config import ConfigError, ResolvedJob
from megainfer.runtime.control import ControlPlane
from megainfer.runtime.eplb.initial import initial_placement
from megainfer.runtime.pipeline.exchange import make_m2n
from megainfer.runtime.rank_parts import (Feature, Rank, build_attention,
                                          build_colocated, build_expert)
from megainfer.runtime.roles import (RankRole, assign_role, expert_rank_ids, leader_ranks,
                                     tp_colour)
from megainfer.runtime.tp.group import TPGroup, late_peer, make_tp_group
from megainfer.runtime import timeouts
from megainfer.runtime.trace import Tracer

log = logging.getLogger("megainfer.runtime")


def wait_policy(job: ResolvedJob, role: RankRole) -> WaitPolicy:
    """Expert ranks idle legitimately while attention runs long steps, and a dead expert rank
    must be named by the attention rank waiting on it: expert ranks wait twice as long."""
    return WaitPolicy(mode=job.comm.wait_mode,
                      timeout_s=timeouts.rank_wait_s(job.comm.timeout_s, role.kind))


@dataclass
class Wiring:
    """One rank's connections (``m2n`` and ``side_comm``: None on a prefill rank)."""

    policy: WaitPolicy
    control: ControlPlane
    m2n: Optional[M2N]
    tp_comm: MPI.Comm
    side_comm: Optional[MPI.Comm]
    closers: list = field(default_factory=list)


def wire_rank(job: ResolvedJob, comm, role: RankRole, bounded=None) -> Wiring:
    """Collective over ``comm`` (every rank of it calls this, in the same order). ``bounded``:
    a ``BoundedComm`` over ``comm`` that makes every collective call bounded and named (a
    re-plan's rebuild; the channels' whole set-up within twice the timeout)."""
    plan, cfg, dev = job.deploy, job.model, job.device.torch_device
    policy = wait_policy(job, role)
    coll = comm if bounded is None else bounded
    m2n = side_comm = None
    if not role.is_prefill:
        leaders = leader_ranks(plan)
        experts = leaders if plan.mode == "colocated" else expert_rank_ids(plan)
        args = (coll, leaders, experts, cfg.hidden_size, cfg.top_k,
                job.scheduler.max_num_batched_tokens, plan.micro_batches, job.load.torch_dtype,
                policy, job.comm.transport, dev)
        m2n = (make_m2n(*args) if bounded is None
               else bounded.call("channels' set-up", make_m2n, *args, scale=2.0))
    tp_comm = coll.Split(tp_colour(plan, role), role.rank)
    if not role.is_prefill:
        side_comm = coll.Split(0 if role.is_attention else 1, role.rank)  # expert ranks' own
    w = Wiring(policy, ControlPlane(comm, role.label, policy), m2n, tp_comm, side_comm)
    if m2n is not None:
        w.closers.append(m2n.close)
        if dev.type == "cuda":  # device buffers, IPC mappings, NCCL communicators (collective)
            w.closers.append(m2n.close_transports)
    return w


def replica_tp_group(job: ResolvedJob, w: Wiring, role: RankRole) -> TPGroup:
    """The TP group of an attention or prefill replica (collective over ``w.tp_comm``), with
    the device channel ``comm.tp_collectives`` asks for."""
    named = late_peer(role.leader_rank, role.tp_rank, role.tp_size)
    return make_tp_group(w.tp_comm, w.control, named, job, job.load.torch_dtype,
                         role.leader_rank, w.closers)


def rank_of(job: ResolvedJob, comm, role: RankRole, w: Wiring, tracer: Tracer) -> Rank:
    """A ``Rank`` holding ``w``'s connections (its parts not built yet)."""
    return Rank(role, tracer, job=job, comm=comm, m2n=w.m2n, policy=w.policy, control=w.control,
                closers=w.closers)


def trace_epoch(comm) -> float:
    """Collective: rank 0's monotonic clock reading, every rank's trace epoch (CLOCK_MONOTONIC
    is shared by the processes of one node; across nodes this is as good as the hosts' clocks)."""
    return comm.bcast(time.perf_counter(), root=0)


def build_base_rank(job: ResolvedJob, comm=MPI.COMM_WORLD, feature: Optional[Feature] = None,
                    make_loop: Optional[Callable] = None) -> Rank:
    """Collective: this rank's role, connections and parts. ``feature``'s ``traced`` may turn
    tracing on; ``make_loop(rank, engine, exchange, first_moe_layer)`` builds the attention
    ranks' loop (default ``ReplicaLoop``)."""
    rank, world = comm.Get_rank(), comm.Get_size()
    plan, cfg = job.deploy, job.model
    role = assign_role(plan, rank, world)
    colocated = plan.mode == "colocated"
    if colocated and job.eplb.enabled:
        raise ConfigError("eplb.enabled=true: live rebalancing runs in disaggregated mode only "
                          "(colocated mode takes static placements: eplb.redundant_experts, "
                          "eplb.initial)")
    dev = job.device.torch_device
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # Triton launches, streams and IPC all on this rank's GPU
    epoch = trace_epoch(comm)
    traced = job.trace.enabled or (feature is not None and feature.traced is not None
                                   and feature.traced(job, role))
    tracer = Tracer(enabled=traced, rank=rank, name=role.label, mode=plan.mode, epoch=epoch,
                    device=dev)
    w = wire_rank(job, comm, role)
    num_experts_ranks = plan.attention_replicas if colocated else plan.expert_ranks
    placement = initial_placement(cfg.num_layers, cfg.num_experts, num_experts_ranks, job.eplb)
    out = rank_of(job, comm, role, w, tracer)
    if colocated:
        build_colocated(job, out, placement)
    elif role.is_attention:
        out.tp = replica_tp_group(job, w, role)
        build_attention(job, out, placement, make_loop=make_loop)
    else:
        build_expert(job, out, placement, w.side_comm)
    return out


def run_base_rank(r: Rank) -> None:
    """A rank other than 0: serve rank 0 (its ``RuntimeEngine``) until stopped."""
    if r.loop is not None:
        r.loop.serve()
    else:
        n = r.worker.run()
        log.debug("%s served %d iterations", r.role.label, n)
    return None
