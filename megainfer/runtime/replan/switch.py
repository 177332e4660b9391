"""Switch the attention:expert split of a running job without a restart.

Every rank calls ``switch`` with the same ``ReplanOrder`` at an iteration boundary (the pipeline
drained). Ranks keep their order, so ``aXeY`` -> ``aX'eY'`` turns the ranks between X and X'
from one role into the other. On a duplicate of the job's communicator: EPLB's placement for
the new expert count; the leaving replicas' requests to the staying ones (KV moved or
recomputed); expert weights point to point; old channels closed, new ones wired
(``wiring.wire_rank``), each rank's part rebuilt (a staying replica keeps its engine); then a
new replica gets the newest requests beyond a fair share. Every wait is bounded by twice
``comm.timeout_s`` and names the rank and the phase (``runtime/bounded.py``). Restrictions:
``deploy.attention_tp=1``, no prefill ranks (``check_replan``). docs/replan.md, "Switch
(`runtime/replan/switch.py`, `runtime/replan/requests.py`, `runtime/replan/weights.py`)"."""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy
from megainfer.config import ConfigError
from megainfer.config.replan import parse_split
from megainfer.perfmodel.trace import REPLAN, replan_name
from megainfer.runtime import tags
from megainfer.runtime.bounded import BoundedComm
from megainfer.runtime.control import ControlPlane
from megainfer.runtime.eplb.weight_channel import eplb_moves_kind
from megainfer.runtime.messages import ReplanOrder
from megainfer.models.loader import load_weight_format
from megainfer.runtime.rank_parts import build_attention, build_expert
from megainfer.runtime.replan.requests import balance_shares, group_count, migrate
from megainfer.runtime.replan.weights import move_expert_weights, new_placement
from megainfer.runtime.roles import assign_role, leader_ranks
from megainfer.runtime.timeouts import switch_wait_s
from megainfer.runtime.wiring import replica_tp_group, wire_rank

log = logging.getLogger("megainfer.runtime")
COUNTED = ("move", "recompute", "waiting", "multi", "kv_bytes")  # sequences handed over


def check_replan(job, world: int) -> None:
    """Refuse, before any work, a job re-planning cannot run."""
    p, r = job.deploy, job.replan
    if p.mode != "disaggregated" or p.attention_tp != 1 or p.prefill_replicas:
        raise ConfigError(f"replan.enabled=true: re-planning runs in deploy.mode=disaggregated "
                          f"with attention_tp=1 and no prefill replicas (got mode={p.mode}, "
                          f"attention_tp={p.attention_tp}, prefill_replicas={p.prefill_replicas})")
    for it, label in r.force_schedule:
        a, e = parse_split(label)
        if a + e != world or e > job.model.num_experts:
            raise ConfigError(f"replan.force_schedule=[{it}, {label!r}]: {a} attention + {e} "
                              f"expert ranks must make the world size {world} "
                              f"(and at most {job.model.num_experts} expert ranks)")


def checkpoint(control, phase: str) -> None:
    """A barrier whose wait is bounded and names the first rank that did not arrive (each rank
    sends every other a token, then waits for theirs in rank order): a rank hung in a phase of
    the switch is named before the next collective call, which would wait for it forever."""
    comm = control.comm
    me, n = comm.Get_rank(), comm.Get_size()
    token = np.zeros(1, dtype=np.int8)
    sends = [comm.Isend(token, dest=k, tag=tags.REPLAN_CHECKPOINT) for k in range(n) if k != me]
    for k in range(n):
        if k != me:
            got = np.empty(1, dtype=np.int8)
            control.wait(comm.Irecv(got, source=k, tag=tags.REPLAN_CHECKPOINT), k, phase)
    for req in sends:
        control.wait(req, None, phase)


def _placement_of(r):
    if r.worker is not None:
        return r.worker.rebalancer.placement
    return r.loop.engine.executor.rebalancer.placement


def switch(r, order: ReplanOrder) -> dict:
    """Collective: turn this rank into its role under ``order.new``. Returns a record of what
    moved (this rank's share; rank 0 logs the job's)."""
    t0 = time.perf_counter()
    job, comm = r.job, r.comm
    rank, world, cfg = comm.Get_rank(), comm.Get_size(), job.model
    old_plan = job.deploy
    new_plan = replace(old_plan, attention_replicas=order.new[0], expert_ranks=order.new[1],
                       micro_batches=order.new[2])
    new_role = assign_role(new_plan, rank, world)
    policy = WaitPolicy(mode=job.comm.wait_mode, timeout_s=switch_wait_s(job.comm.timeout_s))
    bounded = BoundedComm(comm, f"{r.role.label} re-plan", policy, "re-plan start")
    sw = bounded.Dup()
    control = ControlPlane(sw, f"{r.role.label} re-plan", policy)
    t_start = r.tracer.now_us()
    # 1. the new placement, from the load the old expert ranks counted
    checkpoint(control, "re-plan start")
    old_p = _placement_of(r)
    load = (r.worker.rebalancer.window.load().cpu().numpy().astype(np.int64) if r.worker is not None
            else np.zeros((cfg.num_layers, cfg.num_experts), dtype=np.int64))
    total = np.empty_like(load)
    control.wait(sw.Iallreduce(load, total, op=MPI.SUM), None, "re-plan load all-reduce")
    new_p = new_placement(cfg, job.eplb, total, new_plan.expert_ranks)
    checkpoint(control, "re-plan expert placement")
    # 2. requests of leaving replicas to the staying ones
    a0, a1 = old_plan.attention_replicas, new_plan.attention_replicas
    old_leaders, new_leaders = leader_ranks(old_plan), leader_ranks(new_plan)
    leaving, staying = old_leaders[a1:], old_leaders[:min(a0, a1)]
    moved = migrate(control, r.loop, leaving, staying, job.replan.kv_transfer,
                    job.replan.link_gbps * 1e9 / 8, r.role.label) if leaving else {}
    checkpoint(control, "re-plan request hand-over")
    # 3. expert weights into the new expert ranks' slots
    old_model = r.worker.model if r.worker is not None else None
    moves = eplb_moves_kind(job.comm.eplb_moves, job.device.torch_device, job.comm.transport)
    model, weight_bytes, weight_slots = move_expert_weights(sw, control, cfg, job.load.torch_dtype,
                                              job.device.torch_device, old_model, old_p, new_p,
                                              old_plan.attention_ranks, new_plan.attention_ranks,
                                              moves, fmt=load_weight_format(job.load))
    checkpoint(control, "re-plan expert weight moves")  # the channels' rebuild is collective
    # 4. new channels, new parts
    keep = r.loop if (r.loop is not None and new_role.is_attention) else None
    _rebuild(r, replace(job, deploy=new_plan), new_role, new_p, model, keep, order, bounded)
    if a1 > a0:  # 5. new replicas: the old ones give them their newest requests beyond a fair share
        mine = np.zeros(world, dtype=np.int64)
        if r.loop is not None and rank < a0:
            mine[rank] = group_count(r.loop.engine)
        held = np.empty_like(mine)
        control.wait(sw.Iallreduce(mine, held, op=MPI.SUM), None, "re-plan request counts")
        give = balance_shares(held.tolist(), a0, a1)
        if any(give):
            moved = migrate(control, r.loop, old_leaders, new_leaders[a0:],
                            job.replan.kv_transfer, job.replan.link_gbps * 1e9 / 8, r.role.label,
                            limit=dict(enumerate(give)))
    mine = np.array([weight_bytes] + [moved.get(k, 0) for k in COUNTED], dtype=np.int64)
    job_total = np.empty_like(mine)  # the job's totals, for the log and the summary
    control.wait(sw.Iallreduce(mine, job_total, op=MPI.SUM), None, "re-plan totals")
    bounded.free("the switch's communicator freed", sw)
    dt = time.perf_counter() - t0
    r.tracer.add(REPLAN, replan_name(order.label), t_start, r.tracer.now_us() - t_start,
                 order.iteration, -1, -1, 0)
    rec = dict(iteration=order.iteration, old=order.name(order.old), new=order.name(order.new),
               micro_batches=[order.old[2], order.new[2]], kind=order.kind, reason=order.reason,
               predicted_gain=order.predicted_gain, seconds=dt, weight_bytes=int(job_total[0]),
               weight_slots=weight_slots,
               **{k: int(v) for k, v in zip(COUNTED, job_total[1:])})
    if any(moved.get(k) for k in ("move", "recompute", "waiting")):  # a staying replica
        log.info("%s re-plan: requests taken in: %d with their KV, %d to recompute, %d not "
                 "started", r.role.label, moved["move"], moved["recompute"], moved["waiting"])
    return rec


def _rebuild(r, new_job, role, placement, expert_model, keep, order, bounded) -> None:
    comm, plan = r.comm, new_job.deploy
    rank, was_attention = comm.Get_rank(), r.role.is_attention
    r.m2n.close()  # the old channels: cancel what is posted ahead
    bounded.phase = "re-plan channel rebuild"  # every collective call below: bounded, named
    old_side = r.worker.rebalancer.comm if r.worker is not None else None  # old expert ranks'
    bounded.call("old channels closed", r.m2n.close_transports)
    bounded.free("old expert ranks' communicator freed", old_side)
    dev = new_job.device.torch_device
    # the channels: their transports' own collective calls on ``bounded`` are bounded and named
    # one by one; the whole set-up (a device transport's handle exchange too) within twice that
    w = wire_rank(new_job, comm, role, bounded=bounded)
    old_loop = r.loop
    r.role, r.loop, r.worker = role, None, None
    r.tracer.name = role.label
    if not new_job.trace.enabled and rank != 0:  # measured decisions sample rank 0 and experts
        r.tracer.enabled = new_job.replan.measured and not role.is_attention
        if role.is_attention:
            r.tracer.events = []
    r.job, r.m2n, r.policy, r.control, r.closers = new_job, w.m2n, w.policy, w.control, w.closers
    if role.is_attention:
        r.tp = replica_tp_group(new_job, w, role)
        build_attention(new_job, r, placement, engine=keep.engine if keep is not None else None)
        r.loop.engine.executor.iteration = order.iteration
        r.loop.engine.executor.m = plan.micro_batches  # a kept engine: the new count too
        r.loop.stream = order.stream
        if keep is not None:  # rank 0: what is not handed out yet stays queued
            r.loop.continue_from(keep)
    else:
        build_expert(new_job, r, placement, w.side_comm, model=expert_model)
        r.worker.iteration = order.iteration
    if was_attention and old_loop is not None and old_loop is not keep:
        old_loop.engine = None  # a replica that became an expert rank: its KV cache goes
        if dev.type == "cuda":
            import torch
            torch.cuda.empty_cache()

