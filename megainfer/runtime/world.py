"""Build this MPI rank's part of a distributed job from the frozen configs.

Every rank builds both channels in the same order (channel ids are a counter). Then, by mode:

* disaggregated: attention ranks build an attention-role model, a KV cache and an engine whose
  executor is the ping-pong pipeline (``DisaggregatedExecutor``); expert ranks build an
  experts-role model holding only their slots and serve (``ExpertWorker``).
* colocated: every rank builds a full model with its expert-parallel slice of the experts and
  an engine whose executor dispatches to / serves for all ranks (``ColocatedExecutor``).

``run_rank`` returns rank 0's output stream, or None on other ranks.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy
from megainfer.config import (CacheConfig, CommConfig, ConfigError, DeployPlan, DeviceConfig,
                              EplbConfig, LoadConfig, ModelConfig, ReplanConfig, SchedulerConfig,
                              TraceConfig)
from megainfer.models import ParallelContext, build_model

from .attention_executor import DisaggregatedExecutor
from .colocated_executor import ColocatedExecutor
from .control import ControlPlane
from .exchange import AttentionExchange, ExpertExchange, make_m2n
from .expert_worker import ExpertWorker
from .placement import initial_placement
from .rebalancer import AttentionRebalancer, ExpertRebalancer
from .replica_loop import ReplicaLoop
from .roles import assign_role, expert_rank_ids, leader_ranks
from .tp_group import TPGroup, late_peer
from .trace import Tracer

log = logging.getLogger("megainfer.runtime")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class JobSpec:
    """Everything a rank needs to build its part."""

    model: ModelConfig
    load: LoadConfig
    sched: SchedulerConfig
    cache: CacheConfig
    plan: DeployPlan
    comm: CommConfig = CommConfig()
    eplb: EplbConfig = EplbConfig()
    trace: TraceConfig = TraceConfig()
    tokenizer: object = None
    seed: int = 0
    device: DeviceConfig = DeviceConfig()  # cuda: every rank on GPU local_rank % visible
    replan: ReplanConfig = ReplanConfig()  # online re-planning (docs/replan.md)


@dataclass
class Rank:
    """What one rank built; ``loop`` (attention side) or ``worker`` (expert rank) runs it."""

    role: object
    tracer: Tracer
    loop: Optional[ReplicaLoop] = None
    worker: Optional[ExpertWorker] = None
    closers: list = field(default_factory=list)
    parts: dict = field(default_factory=dict)  # what a re-plan rebuilds (runtime/replan_switch.py)

    def close(self) -> None:
        for c in self.closers:
            c()


def build_rank(job: JobSpec, comm=MPI.COMM_WORLD) -> Rank:
    if job.replan.enabled:  # before anything collective: every rank refuses alike
        from .replan_switch import check_replan
        check_replan(job, comm.Get_size())
    if job.plan.prefill_replicas:  # prefill ranks after the rest (docs/pd.md)
        from .pd_world import build_pd_rank
        return build_pd_rank(job, comm, build_rank)
    rank, world = comm.Get_rank(), comm.Get_size()
    plan, cfg = job.plan, job.model
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
                   job.sched.max_num_batched_tokens, plan.micro_batches, DTYPES[job.load.dtype],
                   policy, job.comm.transport, dev)
    placement = initial_placement(cfg.num_layers, cfg.num_experts, len(experts), job.eplb)
    # the attention ranks of one replica share a TP communicator; others get their own colour
    tp_comm = comm.Split(role.replica if role.is_attention else plan.attention_replicas + rank, rank)
    side_comm = comm.Split(0 if role.is_attention else 1, rank)  # expert ranks among themselves
    out = Rank(role, tracer, closers=[m2n.close])
    if dev.type == "cuda":  # device buffers, IPC mappings, NCCL communicators (collective)
        out.closers.append(m2n.close_transports)
    control = ControlPlane(comm, role.tag, policy)
    if colocated:
        _build_colocated(job, out, m2n, placement, control, tracer)
    elif role.is_attention:
        named = late_peer(role.replica * plan.attention_tp, role.tp_rank, plan.attention_tp)
        _build_attention(job, out, m2n, placement, control, TPGroup(tp_comm, control, named),
                         tracer)
    else:
        _build_expert(job, out, m2n, placement, control, side_comm, tracer)
    out.parts = dict(job=job, comm=comm, m2n=m2n, policy=policy, control=control)
    return out


def _build_expert(job, out, m2n, placement, control, side_comm, tracer, model=None):
    """An expert rank's model (``model``: one whose slots are already filled) and worker."""
    me, cfg, plan = out.role.expert_index, job.model, job.plan
    if model is None:
        model = build_model(cfg, job.load, role="experts", phy2log=placement.phy2log.tolist(),
                            expert_slots=[list(placement.slots_of_rank(me))] * cfg.num_layers,
                            device=job.device.torch_device)
    rebalancer = ExpertRebalancer(model, placement, me, side_comm, control, leader_ranks(plan),
                                  job.eplb)
    out.worker = ExpertWorker(model, plan.micro_batches, ExpertExchange(m2n), out.role.tag, tracer,
                              rebalancer)


def _slot_owner(placement, device) -> torch.Tensor:
    """[num_slots] -> index of the expert rank holding the slot (fixed by the contiguous split),
    on the device the router's ids are on."""
    return placement.rank_of_slot(torch.arange(placement.num_replicas)).to(device)


def _engine(job: JobSpec, role, model, make_executor):
    from megainfer.engine.engine import LLMEngine
    return LLMEngine(job.model, job.sched, job.cache, make_executor, job.tokenizer,
                     kv_spec=model.kv_cache_spec(DTYPES[job.load.dtype]),
                     kv_dtype=DTYPES[job.load.dtype], device=job.device.torch_device,
                     seed=job.seed, log_prefix=role.tag)


def _build_attention(job, out, m2n, placement, control, tp, tracer, engine=None):
    """An attention rank's model, engine and loop; ``engine``: keep this one (its model, KV
    cache and requests) and only rewire its executor to the new channels (a re-plan)."""
    role, plan, cfg = out.role, job.plan, job.model
    if engine is None:
        par = ParallelContext(role.tp_rank, plan.attention_tp,
                              tp.all_reduce if tp.size > 1 else None)
        model = build_model(cfg, job.load, par, role="attention", device=job.device.torch_device)
        model.set_attention_backend(job.device.attention_backend)
    else:
        model = engine.executor.model
    exchange = rebalancer = None
    if role.is_leader:
        exchange = AttentionExchange(m2n, _slot_owner(placement, job.device.torch_device), tracer)
        rebalancer = AttentionRebalancer(placement, job.eplb, control, m2n,
                                         expert_rank_ids(plan)[0], role.replica)
    if engine is None:
        engine = _engine(job, role, model, lambda kv: DisaggregatedExecutor(
            model, kv, job.cache.block_size, plan.micro_batches, exchange, tp, rebalancer, tracer))
    else:
        ex = engine.executor
        ex.exchange, ex.rebalancer, ex.tp = exchange, rebalancer, tp
    out.loop = ReplicaLoop(engine, role, plan, control, exchange, cfg.moe_layers()[0])


def _build_colocated(job, out, m2n, placement, control, tracer):
    role, plan, cfg = out.role, job.plan, job.model
    mine = list(placement.slots_of_rank(role.replica))
    model = build_model(cfg, job.load, role="full", expert_slots=[mine] * cfg.num_layers,
                        phy2log=placement.phy2log.tolist(), device=job.device.torch_device)
    model.set_attention_backend(job.device.attention_backend)
    expert_side = ExpertExchange(m2n)  # its receives and sends are grouped with the attention
    exchange = AttentionExchange(m2n, _slot_owner(placement, job.device.torch_device), tracer,
                                 lanes=("dispatch", "combine"), partner=expert_side)  # side's
    worker = ExpertWorker(model, plan.micro_batches, expert_side, role.tag, tracer,
                          trace_comm=False)
    rebalancer = AttentionRebalancer(placement, job.eplb, control, m2n, 0, role.replica)
    engine = _engine(job, role, model, lambda kv: ColocatedExecutor(
        model, kv, job.cache.block_size, plan.micro_batches, exchange, worker, rebalancer, tracer))
    out.loop = ReplicaLoop(engine, role, plan, control, None, cfg.moe_layers()[0])


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
