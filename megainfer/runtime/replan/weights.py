"""A re-plan's expert side: the new placement over the new expert ranks, and its weights moved
point to point from the ranks that held them (docs/replan.md).

The placement is EPLB's (``Placement.from_rebalance``) over the load the old expert ranks
counted (their windows summed), with the slots padded to a multiple of the new rank count as
at launch (``runtime/eplb/initial.py``); with no load counted yet, the launch placement for that
count. Every rank computes the same move list: each slot of each new expert rank takes its
logical expert from itself when it held it, else from one old holder (the holders take turns,
as in ``eplb.weight_moves``). Weights travel as one buffer per (layer, slot), over one of live
rebalancing's two paths (``comm.eplb_moves``, docs/eplb.md): device to device over a transport
built on the switch communicator for these moves (``runtime/eplb/weight_channel.py``), or staged on
the host over MPI. The receiving rank builds an experts-role model with empty slots and fills
every slot from what arrived.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from mpi4py import MPI

from megainfer.eplb import Placement
from megainfer.models import ParallelContext
from megainfer.models.loader import _materialize, _on_meta
from megainfer.models.model import MoECausalLM
from megainfer.models.quant_weights import apply_weight_format
from megainfer.runtime import tags
from megainfer.runtime.eplb.initial import initial_placement
from megainfer.runtime.eplb.rebalancer import (_flat, _host, _np, _parts, empty_slot,
                                               install_staged)
from megainfer.runtime.eplb.weight_channel import Inbound, Outbound, run_moves, world_ranks_of



def new_placement(cfg, eplb, load: np.ndarray, num_ranks: int) -> Placement:
    """[L, E] summed token counts -> the placement over ``num_ranks`` expert ranks."""
    start = initial_placement(cfg.num_layers, cfg.num_experts, num_ranks, eplb)
    if load.sum() <= 0:
        return start
    weight = torch.from_numpy(load).double() + 1.0  # an expert never seen still gets a slot
    return Placement.from_rebalance(weight, start.num_replicas, eplb.groups_for(cfg),
                                    eplb.num_nodes, num_ranks)


def plan_moves(old: Placement, new: Placement, old_first: int, new_first: int, moe_layers):
    """[(layer, dst world rank, dst local slot, src world rank, src local slot)] for every slot
    of every new expert rank; ranks are world ranks (expert ranks start at ``*_first``)."""
    S0, S1 = old.slots_per_rank, new.slots_per_rank
    moves = []
    for j in range(new.num_ranks):
        dst = new_first + j
        for layer in moe_layers:
            for t in range(S1):
                e = int(new.phy2log[layer, j * S1 + t])
                holders = {}  # old expert index -> first local slot holding e
                for p in old.log2phy[layer, e].tolist():
                    if p >= 0:
                        holders.setdefault(p // S0, p % S0)
                me = dst - old_first
                if me in holders:
                    src, slot = me, holders[me]
                else:
                    order = sorted(holders.items())
                    src, slot = order[j % len(order)]
                moves.append((layer, dst, t, old_first + src, slot))
    return moves


def _empty_experts(cfg, dtype, slots, num_slots, device, fmt=None) -> MoECausalLM:
    """An experts-role model holding ``slots`` with uninitialised weights (filled by the moves),
    in weight format ``fmt`` (None: ``dtype``) as the old expert ranks hold them."""
    with _on_meta():
        model = MoECausalLM(cfg, ParallelContext(), "experts", [list(slots)] * cfg.num_layers,
                            num_slots)
        apply_weight_format(model, fmt)
    _materialize(model, dtype, device)
    return model.eval().requires_grad_(False)


def move_expert_weights(sw: MPI.Comm, control, cfg, dtype: torch.dtype, device, old_model,
                        old: Placement, new: Placement, old_first: int, new_first: int,
                        kind: Optional[str] = None, fmt=None):
    """Collective over ``sw``: every rank sends the slots it owes; a new expert rank returns
    its filled model (others None), the bytes it received from peers and the number of
    (layer, slot) moves between ranks (the same on every rank). ``kind``: the
    transport the weights move on device to device (``weight_channel.eplb_moves_kind``), None
    for host staging over MPI. ``fmt``: the weight format experts are kept in (quantised
    slots travel as their stored bytes and scales)."""
    me = sw.Get_rank()
    moves = plan_moves(old, new, old_first, new_first, cfg.moe_layers())
    j = me - new_first
    model = None
    if 0 <= j < new.num_ranks:
        model = _empty_experts(cfg, dtype, new.slots_of_rank(j), new.num_replicas,
                               device, fmt)
    remote = [mv for mv in moves if mv[1] != mv[3]]  # every rank alike
    if kind is not None and remote:
        wire = torch.uint8 if fmt is not None else dtype  # move_dtype, on every rank alike
        staged, received = _stage_device(sw, control, kind, device, wire,
                                         old_model, model, moves, remote, me)
    else:
        staged, received = _stage_host(sw, control, old_model, model, moves, me,
                                       new.slots_per_rank)
    if model is not None:
        install_staged(model, staged)
    return model, received, len(remote)


def _stage_device(sw, control, kind, device, dtype, old_model, model, moves, remote, me):
    """Device to device over a transport built on ``sw`` for these moves (collective)."""
    outs, ins, staged, received = [], [], {}, 0
    for layer, dst, t, src, slot in moves:
        if src == me and dst != me:
            ex = old_model.layers[layer].mlp.experts
            outs.append(Outbound(dst, layer, t, _parts(ex, slot)))
        elif dst == me:
            if src == me:
                staged[(layer, t)] = _flat(old_model.layers[layer].mlp.experts, slot)
                continue
            ex = model.layers[layer].mlp.experts
            buf = empty_slot(ex, t, ex.gate_up_proj.device)
            ins.append(Inbound(src, layer, t, buf))
            staged[(layer, t)] = buf
            received += buf.numel() * buf.element_size()
    senders = sorted({mv[3] for mv in remote})
    receivers = sorted({mv[1] for mv in remote})
    run_moves(kind, sw, device, dtype, senders, receivers, control, world_ranks_of(sw),
              "re-plan expert weight move", outs, ins)
    return staged, received


def _stage_host(sw, control, old_model, model, moves, me, S1):
    """Through host memory over MPI: one Isend/Irecv of a host buffer per move."""
    reqs, staged, received = [], {}, 0
    for layer, dst, t, src, slot in moves:
        if src == me and dst != me:  # my old slot -> a peer's new slot
            ex = old_model.layers[layer].mlp.experts
            buf = _host(_flat(ex, slot))
            reqs.append((sw.Isend(_np(buf), dest=dst, tag=tags.REPLAN_EXPERT + layer * S1 + t),
                         dst, buf))
    if model is not None:
        for layer, dst, t, src, slot in moves:
            if dst != me:
                continue
            ex = model.layers[layer].mlp.experts
            if src == me:
                staged[(layer, t)] = _flat(old_model.layers[layer].mlp.experts, slot)
                continue
            buf = empty_slot(ex, t)
            reqs.append((sw.Irecv(_np(buf), source=src, tag=tags.REPLAN_EXPERT + layer * S1 + t),
                         src, buf))
            staged[(layer, t)] = buf
            received += buf.numel() * buf.element_size()
    for req, peer, _ in reqs:
        control.wait(req, peer, "re-plan expert weight move")
    return staged, received
