"""Build this MPI rank's part of a distributed job from the frozen configs.

Every rank builds both channels in the same order (channel ids are a counter). Then, by mode:

* disaggregated: attention ranks build an attention-role model, a KV cache and an engine whose
  executor is the ping-pong pipeline (``DisaggregatedExecutor``); expert ranks build an
  experts-role model holding only their slots and serve (``ExpertWorker``).
* colocated: every rank builds a full model with its expert-parallel slice of the experts and
  an engine whose executor dispatches to / serves for all ranks (``ColocatedExecutor``).

The parts themselves (models, engines, loops, workers) are built in ``rank_parts``.
``run_rank`` returns rank 0's output stream, or None on other ranks.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable, Optional

import torch
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy
from megainfer.config import ConfigError, ResolvedJob

from .control import ControlPlane
from .exchange import make_m2n
from .placement import initial_placement
from .rank_parts import Rank, build_attention, build_colocated, build_expert
from .roles import assign_role, expert_rank_ids, leader_ranks
from .tp_group import late_peer, make_tp_group
from .trace import Tracer

log = logging.getLogger("megainfer.runtime")
def build_rank(job: ResolvedJob, comm=MPI.COMM_WORLD) -> Rank:
    if job.replan.enabled:  # before anything collective: every rank refuses alike
        from .replan_switch import check_replan
        check_replan(job, comm.Get_size())
    if job.deploy.prefill_replicas:  # prefill ranks after the rest (docs/pd.md)
        from .pd_world import build_pd_rank
        return build_pd_rank(job, comm, build_rank)
    rank, world = comm.Get_rank(), comm.Get_size()
    plan, cfg = job.deploy, job.model
    role = assign_role(plan, rank, world)
    colocated = plan.mode == "colocated"
    if colocated and job.eplb.enabled:
        raise ConfigError("eplb.enabled=true: live rebalancing runs in disaggregated mode only "
                          "(colocated mode takes static placements: eplb.redundant_experts, "
                          "eplb.initial)")
    # expert ranks idle legitimately while attention runs long steps, and a dead expert rank
    # must be named by the attention rank waiting on it: expert ranks wait twice as long
    policy = WaitPolicy(mode=job.comm.wait_mode,
                        timeout_s=job.comm.timeout_s * (1 if role.is_attention else 2))
    # one clock: rank 0's monotonic clock reading is every rank's trace epoch (CLOCK_MONOTONIC is
    # shared by the processes of one node; across nodes this is as good as the hosts' clocks)
    dev = job.device.torch_device
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # Triton launches, streams and IPC all on this rank's GPU
    epoch = comm.bcast(time.perf_counter(), root=0)
    traced = job.trace.enabled or (job.replan.enabled and not job.replan.force_schedule and
                                   (rank == 0 or not role.is_attention))  # replan_measure.py
    tracer = Tracer(enabled=traced, rank=rank, name=role.tag, mode=plan.mode, epoch=epoch,
                    device=dev)
    leaders = leader_ranks(plan)
    experts = leaders if colocated else expert_rank_ids(plan)
    m2n = make_m2n(comm, leaders, experts, cfg.hidden_size, cfg.top_k,
                   job.scheduler.max_num_batched_tokens, plan.micro_batches, job.load.torch_dtype,
                   policy, job.comm.transport, dev)
    placement = initial_placement(cfg.num_layers, cfg.num_experts, len(experts), job.eplb)
    # the attention ranks of one replica share a TP communicator; others get their own colour
    tp_comm = comm.Split(role.replica if role.is_attention else plan.attention_replicas + rank, rank)
    side_comm = comm.Split(0 if role.is_attention else 1, rank)  # expert ranks among themselves
    out = Rank(role, tracer, closers=[m2n.close])
    if dev.type == "cuda":  # device buffers, IPC mappings, NCCL communicators (collective)
        out.closers.append(m2n.close_transports)
    control = ControlPlane(comm, role.tag, policy)
    tp = None
    if colocated:
        build_colocated(job, out, m2n, placement, control, tracer)
    elif role.is_attention:
        named = late_peer(role.replica * plan.attention_tp, role.tp_rank, plan.attention_tp)
        tp = make_tp_group(tp_comm, control, named, job, job.load.torch_dtype,
                           role.replica * plan.attention_tp, out.closers)
        build_attention(job, out, m2n, placement, control, tp, tracer)
    else:
        build_expert(job, out, m2n, placement, control, side_comm, tracer)
    out.parts = dict(job=job, comm=comm, m2n=m2n, policy=policy, control=control, tp=tp)
    return out


def run_rank(r: Rank, inputs: Optional[Iterable] = None):
    """Rank 0: a generator of outputs. Others: serve until stopped, then return None."""
    if r.parts.get("job") is not None and r.parts["job"].replan.enabled:
        from .replan_runner import run_replanning
        return run_replanning(r, inputs)
    if r.role.rank == 0:
        return r.loop.generate_stream(inputs or [])
    if r.loop is not None:
        r.loop.serve()
    else:
        n = r.worker.run()
        log.debug("%s served %d iterations", r.role.tag, n)
    return None
