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
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy
from megainfer.config import CacheConfig, DeployPlan, LoadConfig, ModelConfig, SchedulerConfig
from megainfer.models import ParallelContext, build_model

from .attention_executor import DisaggregatedExecutor
from .colocated_executor import ColocatedExecutor
from .control import ControlPlane
from .exchange import AttentionExchange, ExpertExchange, make_m2n
from .expert_worker import ExpertWorker
from .placement import identity_slots
from .replica_loop import ReplicaLoop
from .roles import assign_role, expert_rank_ids, leader_ranks
from .tp_group import TPGroup
from .trace import Tracer

log = logging.getLogger("megainfer.runtime")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RuntimeConfig:
    """Knobs of the distributed runtime (``comm.*`` / ``trace.*`` in the launcher)."""

    timeout_s: float = 30.0  # a peer silent for longer is declared failed
    wait_mode: str = "backoff"  # spin | yield | backoff (see megainfer.comm.wait)
    transport: str = "mpi"  # mpi | nccl
    trace: bool = False

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"comm.timeout_s={self.timeout_s!r}: must be > 0")
        if self.transport not in ("mpi", "nccl"):
            raise ValueError(f"comm.transport={self.transport!r}: must be mpi or nccl")
        WaitPolicy(mode=self.wait_mode)  # validates the mode


@dataclass
class JobSpec:
    """Everything a rank needs to build its part."""

    model: ModelConfig
    load: LoadConfig
    sched: SchedulerConfig
    cache: CacheConfig
    plan: DeployPlan
    rt: RuntimeConfig = RuntimeConfig()
    tokenizer: object = None
    seed: int = 0


@dataclass
class Rank:
    """What one rank built; ``loop`` (attention side) or ``worker`` (expert rank) runs it."""

    role: object
    tracer: Tracer
    loop: Optional[ReplicaLoop] = None
    worker: Optional[ExpertWorker] = None
    closers: list = field(default_factory=list)

    def close(self) -> None:
        for c in self.closers:
            c()


def build_rank(job: JobSpec, comm=MPI.COMM_WORLD) -> Rank:
    rank, world = comm.Get_rank(), comm.Get_size()
    plan, cfg = job.plan, job.model
    role = assign_role(plan, rank, world)
    policy = WaitPolicy(mode=job.rt.wait_mode, timeout_s=job.rt.timeout_s)
    comm.Barrier()  # one clock: every rank's trace epoch is taken right after this barrier
    tracer = Tracer(enabled=job.rt.trace, rank=rank, name=role.tag, mode=plan.mode)
    colocated = plan.mode == "colocated"
    leaders = leader_ranks(plan)
    experts = leaders if colocated else expert_rank_ids(plan)
    m2n = make_m2n(comm, leaders, experts, cfg.hidden_size, cfg.top_k,
                   job.sched.max_num_batched_tokens, plan.micro_batches, DTYPES[job.load.dtype],
                   policy, job.rt.transport)
    slots = identity_slots(cfg.num_experts, len(experts))  # [expert index] -> slots
    # the attention ranks of one replica share a TP communicator; others get their own colour
    tp_comm = comm.Split(role.replica if role.is_attention else plan.attention_replicas + rank, rank)
    out = Rank(role, tracer, closers=[m2n.close])
    control = ControlPlane(comm, role.tag, policy)
    if colocated:
        _build_colocated(job, out, m2n, slots, control, tracer)
    elif role.is_attention:
        _build_attention(job, out, m2n, slots, control, TPGroup(tp_comm, control, role.replica *
                                                                plan.attention_tp), tracer)
    else:
        model = build_model(cfg, job.load, role="experts",
                            expert_slots=[slots[role.expert_index]] * cfg.num_layers)
        out.worker = ExpertWorker(model, plan.micro_batches, ExpertExchange(m2n), role.tag, tracer)
    return out


def _slot_owner(num_slots: int, slots: list[list[int]]) -> torch.Tensor:
    owner = torch.empty(num_slots, dtype=torch.long)  # [num_slots] -> expert index
    for j, s in enumerate(slots):
        owner[torch.tensor(s, dtype=torch.long)] = j
    return owner


def _engine(job: JobSpec, role, model, make_executor):
    from megainfer.engine.engine import LLMEngine
    return LLMEngine(job.model, job.sched, job.cache, make_executor, job.tokenizer,
                     kv_heads=model.layers[0].self_attn.kv_heads, kv_dtype=DTYPES[job.load.dtype],
                     seed=job.seed, log_prefix=role.tag)


def _build_attention(job, out, m2n, slots, control, tp, tracer):
    role, plan, cfg = out.role, job.plan, job.model
    par = ParallelContext(role.tp_rank, plan.attention_tp, tp.all_reduce if tp.size > 1 else None)
    model = build_model(cfg, job.load, par, role="attention")
    exchange = AttentionExchange(m2n, _slot_owner(cfg.num_experts, slots), tracer) \
        if role.is_leader else None
    engine = _engine(job, role, model, lambda kv: DisaggregatedExecutor(
        model, kv, job.cache.block_size, plan.micro_batches, exchange, tp, tracer=tracer))
    out.loop = ReplicaLoop(engine, role, plan, control, exchange, cfg.moe_layers()[0])


def _build_colocated(job, out, m2n, slots, control, tracer):
    role, plan, cfg = out.role, job.plan, job.model
    mine = slots[role.replica]
    model = build_model(cfg, job.load, role="full", expert_slots=[mine] * cfg.num_layers)
    exchange = AttentionExchange(m2n, _slot_owner(cfg.num_experts, slots), tracer,
                                 lanes=("dispatch", "combine"))
    worker = ExpertWorker(model, plan.micro_batches, ExpertExchange(m2n), role.tag, tracer,
                          trace_comm=False)
    engine = _engine(job, role, model, lambda kv: ColocatedExecutor(
        model, kv, job.cache.block_size, plan.micro_batches, exchange, worker, tracer=tracer))
    out.loop = ReplicaLoop(engine, role, plan, control, None, cfg.moe_layers()[0])


def run_rank(r: Rank, inputs: Optional[Iterable] = None):
    """Rank 0: a generator of outputs. Others: serve until stopped, then return None."""
    if r.role.rank == 0:
        return r.loop.generate_stream(inputs or [])
    if r.loop is not None:
        r.loop.serve()
    else:
        n = r.worker.run()
        log.debug("%s served %d iterations", r.role.tag, n)
    return None
