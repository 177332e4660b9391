"""The parts one rank of a distributed job is made of, built from the frozen configs: an
attention rank's model, engine and replica loop; an expert rank's model and worker; a colocated
rank's both. ``wiring.build_base_rank`` builds them on the connections ``wiring.wire_rank``
made; a re-plan (``replan/switch.py``) rebuilds them the same way.

``Rank`` is what a rank built (typed fields); ``Feature`` is how a mode beyond the base plugs
into the start-up (``startup.py`` picks it; docs/architecture.md, "Runtime rooms").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megainfer.comm import M2N
from megainfer.comm.wait import WaitPolicy
from megainfer.config import ResolvedJob
from megainfer.models import ParallelContext, build_model
from megainfer.perfmodel.trace import COMBINE, DISPATCH
from megainfer.runtime.control import ControlPlane
from megainfer.runtime.eplb.rebalancer import AttentionRebalancer, ExpertRebalancer
from megainfer.runtime.eplb.weight_channel import eplb_moves_kind
from megainfer.runtime.pipeline.attention_executor import DisaggregatedExecutor
from megainfer.runtime.pipeline.colocated_executor import ColocatedExecutor
from megainfer.runtime.pipeline.exchange import AttentionExchange, ExpertExchange
from megainfer.runtime.pipeline.expert_worker import ExpertWorker
from megainfer.runtime.replicas.loop import ReplicaLoop
from megainfer.runtime.roles import RankRole, expert_rank_ids, leader_ranks
from megainfer.runtime.tp.group import TPGroup
from megainfer.runtime.trace import Tracer

@dataclass
class Rank:
    """What one rank built; ``loop`` (attention side) or ``worker`` (expert or prefill rank)
    runs it. A re-plan replaces the connections and parts in place (``replan/switch.py``)."""

    role: RankRole
    tracer: Tracer
    job: Optional[ResolvedJob] = None  # the plan in it changes at a re-plan
    comm: Optional[object] = None  # the job's communicator (PD: the decode and expert ranks')
    m2n: Optional[M2N] = None
    policy: Optional[WaitPolicy] = None
    control: Optional[ControlPlane] = None
    tp: Optional[TPGroup] = None
    loop: Optional[ReplicaLoop] = None
    worker: Optional[object] = None  # ExpertWorker | PrefillWorker
    closers: list = field(default_factory=list)
    # what runs after each iteration this rank serves as an expert rank (ExpertWorker's
    # ``iteration_hooks``): the same list for every worker a re-plan builds here
    expert_hooks: list = field(default_factory=list)
    feature: Optional["Feature"] = None  # the mode plugged in at start-up (None: the base)
    replans: list = field(default_factory=list)  # rank 0 of a re-planning job: each switch
    replan_decisions: list = field(default_factory=list)  # ... and each measured decision

    def close(self) -> None:
        """Close this rank's connections (once: a second call does nothing)."""
        closers, self.closers = self.closers, []
        for c in closers:
            c()


@dataclass(frozen=True)
class Feature:
    """A mode beyond the base start-up (prefill replicas: ``pd.PD``; re-planning:
    ``replan.REPLAN``), the one named point where it plugs in. ``startup.build_rank`` takes the
    first of ``startup.FEATURES`` the job ``wants``; the base start-up never imports a feature.

    * ``check(job, world)``: refuse, before anything collective, a job the feature cannot run;
    * ``build(job, comm) -> Rank``: build instead of the base (calling it for the ranks it keeps);
    * ``traced(job, role)``: whether this rank records spans although ``trace.enabled`` is off;
    * ``run(rank)``: run a rank other than 0 instead of the base;
    * ``online(rank) -> OnlinePlug``: rank 0 serving online (``runtime_engine.RuntimeEngine``)
      hands the feature each iteration's end and its close (the other ranks still ``run``)."""

    name: str
    wants: Callable
    check: Optional[Callable] = None
    build: Optional[Callable] = None
    traced: Optional[Callable] = None
    run: Optional[Callable] = None
    online: Optional[Callable] = None


def build_expert(job, out: Rank, placement, side_comm, model=None) -> None:
    """An expert rank's model (``model``: one whose slots are already filled) and worker, on
    ``out``'s connections."""
    me, cfg, plan = out.role.expert_index, job.model, job.deploy
    if model is None:
        model = build_model(cfg, job.load, role="experts", phy2log=placement.phy2log.tolist(),
                            expert_slots=[list(placement.slots_of_rank(me))] * cfg.num_layers,
                            device=job.device.torch_device)
    rebalancer = ExpertRebalancer(model, placement, me, side_comm, out.control, leader_ranks(plan),
                                  job.eplb, eplb_moves_kind(job.comm.eplb_moves,
                                                            job.device.torch_device,
                                                            job.comm.transport))
    out.worker = ExpertWorker(model, plan.micro_batches, ExpertExchange(out.m2n), out.role.label,
                              out.tracer, rebalancer)
    out.worker.iteration_hooks = out.expert_hooks


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
                     seed=job.seed, log_prefix=role.label)


def build_attention(job, out: Rank, placement, engine=None,
                    make_loop: Optional[Callable] = None) -> None:
    """An attention rank's model, engine and loop on ``out``'s connections and TP group;
    ``engine``: keep this one (its model, KV cache and requests) and only rewire its executor
    to the new channels (a re-plan). ``make_loop(out, engine, exchange, first_moe_layer)``:
    the loop (default ``ReplicaLoop``; prefill replicas give theirs, ``pd/build.py``)."""
    role, plan, cfg, tp, tracer = out.role, job.deploy, job.model, out.tp, out.tracer
    if engine is None:
        par = ParallelContext(role.tp_rank, plan.attention_tp,
                              tp.all_reduce if tp.size > 1 else None)
        model = build_model(cfg, job.load, par, role="attention", device=job.device.torch_device)
        model.set_attention_backend(job.device.attention_backend)
    else:
        model = engine.executor.model
    exchange = rebalancer = None
    if role.is_leader:
        exchange = AttentionExchange(out.m2n, slot_owner(placement, job.device.torch_device),
                                     tracer)
        rebalancer = AttentionRebalancer(placement, job.eplb, out.control, out.m2n,
                                         expert_rank_ids(plan)[0], role.replica)
    if engine is None:
        engine = make_engine(job, role, model, lambda kv: DisaggregatedExecutor(
            model, kv, job.cache.block_size, plan.micro_batches, exchange, tp, rebalancer, tracer))
    else:
        ex = engine.executor
        ex.exchange, ex.rebalancer, ex.tp = exchange, rebalancer, tp
    if make_loop is None:
        out.loop = ReplicaLoop(engine, role, plan, out.control, exchange, cfg.moe_layers()[0])
    else:
        out.loop = make_loop(out, engine, exchange, cfg.moe_layers()[0])


def build_colocated(job, out: Rank, placement) -> None:
    role, plan, cfg, tracer, m2n = out.role, job.deploy, job.model, out.tracer, out.m2n
    mine = list(placement.slots_of_rank(role.replica))
    model = build_model(cfg, job.load, role="full", expert_slots=[mine] * cfg.num_layers,
                        phy2log=placement.phy2log.tolist(), device=job.device.torch_device)
    model.set_attention_backend(job.device.attention_backend)
    expert_side = ExpertExchange(m2n)  # its receives and sends are grouped with the attention
    exchange = AttentionExchange(m2n, slot_owner(placement, job.device.torch_device), tracer,
                                 lanes=(DISPATCH, COMBINE), partner=expert_side)  # side's
    worker = ExpertWorker(model, plan.micro_batches, expert_side, role.label, tracer,
                          trace_comm=False)
    rebalancer = AttentionRebalancer(placement, job.eplb, out.control, m2n, 0, role.replica)
    engine = make_engine(job, role, model, lambda kv: ColocatedExecutor(
        model, kv, job.cache.block_size, plan.micro_batches, exchange, worker, rebalancer, tracer))
    out.loop = ReplicaLoop(engine, role, plan, out.control, None, cfg.moe_layers()[0])
