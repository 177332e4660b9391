"""The parts one rank of a distributed job is made of, built from the job's frozen config
(``megainfer.config.ResolvedJob``): an attention rank's model, engine and replica loop; an expert
rank's model and worker; a colocated rank's both. ``world.build_rank`` wires them to the channels at start-up; a re-plan
(replan_switch.py) and a prefill replica (pd_world.py) build them the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megainfer.config import ResolvedJob
from megainfer.models import ParallelContext, build_model

from .attention_executor import DisaggregatedExecutor
from .colocated_executor import ColocatedExecutor
from .exchange import AttentionExchange, ExpertExchange
from .expert_worker import ExpertWorker
from .rebalancer import AttentionRebalancer, ExpertRebalancer
from .replica_loop import ReplicaLoop
from .roles import expert_rank_ids, leader_ranks
from .trace import Tracer
from .weight_channel import eplb_moves_kind


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


def build_expert(job, out, m2n, placement, control, side_comm, tracer, model=None):
    """An expert rank's model (``model``: one whose slots are already filled) and worker."""
    me, cfg, plan = out.role.expert_index, job.model, job.deploy
    if model is None:
        model = build_model(cfg, job.load, role="experts", phy2log=placement.phy2log.tolist(),
                            expert_slots=[list(placement.slots_of_rank(me))] * cfg.num_layers,
                            device=job.device.torch_device)
    rebalancer = ExpertRebalancer(model, placement, me, side_comm, control, leader_ranks(plan),
                                  job.eplb, eplb_moves_kind(job.comm.eplb_moves,
                                                            job.device.torch_device,
                                                            job.comm.transport))
    out.worker = ExpertWorker(model, plan.micro_batches, ExpertExchange(m2n), out.role.tag, tracer,
                              rebalancer)


def slot_owner(placement, device) -> torch.Tensor:
    """[num_slots] -> index of the expert rank holding the slot (fixed by the contiguous split),
    on the device the router's ids are on."""
    return placement.rank_of_slot(torch.arange(placement.num_replicas)).to(device)


def make_engine(job: ResolvedJob, role, model, make_executor):
    from megainfer.engine.engine import LLMEngine
    from megainfer.engine.tokenizer import load_tokenizer
    return LLMEngine(job.model, job.scheduler, job.cache, make_executor,
                     load_tokenizer(job.load.path, job.model.eos_token_id),
                     kv_spec=model.kv_cache_spec(job.load.torch_dtype),
                     kv_dtype=job.load.torch_dtype, device=job.device.torch_device,
                     seed=job.seed, log_prefix=role.tag)


def build_attention(job, out, m2n, placement, control, tp, tracer, engine=None):
    """An attention rank's model, engine and loop; ``engine``: keep this one (its model, KV
    cache and requests) and only rewire its executor to the new channels (a re-plan)."""
    role, plan, cfg = out.role, job.deploy, job.model
    if engine is None:
        par = ParallelContext(role.tp_rank, plan.attention_tp,
                              tp.all_reduce if tp.size > 1 else None)
        model = build_model(cfg, job.load, par, role="attention", device=job.device.torch_device)
        model.set_attention_backend(job.device.attention_backend)
    else:
        model = engine.executor.model
    exchange = rebalancer = None
    if role.is_leader:
        exchange = AttentionExchange(m2n, slot_owner(placement, job.device.torch_device), tracer)
        rebalancer = AttentionRebalancer(placement, job.eplb, control, m2n,
                                         expert_rank_ids(plan)[0], role.replica)
    if engine is None:
        engine = make_engine(job, role, model, lambda kv: DisaggregatedExecutor(
            model, kv, job.cache.block_size, plan.micro_batches, exchange, tp, rebalancer, tracer))
    else:
        ex = engine.executor
        ex.exchange, ex.rebalancer, ex.tp = exchange, rebalancer, tp
    out.loop = ReplicaLoop(engine, role, plan, control, exchange, cfg.moe_layers()[0])


def build_colocated(job, out, m2n, placement, control, tracer):
    role, plan, cfg = out.role, job.deploy, job.model
    mine = list(placement.slots_of_rank(role.replica))
    model = build_model(cfg, job.load, role="full", expert_slots=[mine] * cfg.num_layers,
                        phy2log=placement.phy2log.tolist(), device=job.device.torch_device)
    model.set_attention_backend(job.device.attention_backend)
    expert_side = ExpertExchange(m2n)  # its receives and sends are grouped with the attention
    exchange = AttentionExchange(m2n, slot_owner(placement, job.device.torch_device), tracer,
                                 lanes=("dispatch", "combine"), partner=expert_side)  # side's
    worker = ExpertWorker(model, plan.micro_batches, expert_side, role.tag, tracer,
                          trace_comm=False)
    rebalancer = AttentionRebalancer(placement, job.eplb, control, m2n, 0, role.replica)
    engine = make_engine(job, role, model, lambda kv: ColocatedExecutor(
        model, kv, job.cache.block_size, plan.micro_batches, exchange, worker, rebalancer, tracer))
    out.loop = ReplicaLoop(engine, role, plan, control, None, cfg.moe_layers()[0])
