"""Live EPLB: rebalance expert placement at an iteration boundary, without a restart.

Every ``eplb.interval`` iterations, before the iteration's first message, each replica leader
sends every expert rank a REBALANCE control message on the dispatch channel. The expert ranks
sum their load windows (each counts the tokens that reached its own slots, by logical
expert), all compute the same new placement (``Placement.from_rebalance`` is deterministic),
move weights point to point (staged into fresh host buffers, then switched: on a GPU they
travel through host memory), and expert rank 0
sends the new ``phy2log`` to the leaders, which switch their replica choice before sending the
iteration's tokens. Physical slots stay on their rank, so ``expert_map`` never changes; only
which logical expert a slot holds does.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from mpi4py import MPI

from megainfer.comm.spec import KIND_REBALANCE
from megainfer.config import EplbConfig
from megainfer.eplb import ExpertLoadWindow, Placement, weight_moves, weight_sends

from .control import ControlPlane

log = logging.getLogger("megainfer.runtime")
TAG_PLACEMENT = 105
TAG_WEIGHTS = 1000  # + layer * num_slots + global destination slot


class AttentionRebalancer:
    """Replica leader side: replica choice under the current placement, and the trigger."""

    def __init__(self, placement: Placement, eplb: EplbConfig, control: ControlPlane, m2n,
                 expert0: int, replica: int):
        self.placement, self.eplb, self.control, self.m2n = placement, eplb, control, m2n
        self.expert0, self.replica = expert0, replica

    def to_physical(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Logical top-k ids [n, k] -> physical slots [n, k], replicas sharing the load."""
        return self.placement.choose_replicas(layer, ids, offset=self.replica)

    def due(self, iteration: int) -> bool:
        return self.eplb.enabled and iteration > 0 and iteration % self.eplb.interval == 0

    def run(self, iteration: int, first_layer: int) -> None:
        sends = [self.m2n.a2e.send_control(r, KIND_REBALANCE, iteration=iteration,
                                           layer=first_layer, micro_batch=0)
                 for r in self.m2n.expert_ranks]
        for h in sends:
            h.wait()
        phy2log = self.control.recv(self.expert0, TAG_PLACEMENT, "EPLB placement hand-over")
        self.placement = Placement.from_phy2log(torch.tensor(phy2log), self.placement.num_experts,
                                                self.placement.num_ranks)


class ExpertRebalancer:
    """Expert rank side: the load window, the agreement, the weight moves."""

    def __init__(self, model, placement: Placement, index: int, expert_comm: MPI.Comm,
                 control: ControlPlane, leaders: list[int], eplb: EplbConfig):
        self.model, self.placement, self.index = model, placement, index
        self.comm, self.control, self.leaders, self.eplb = expert_comm, control, leaders, eplb
        self.window = ExpertLoadWindow(placement.num_layers, placement.num_experts, eplb.window)
        self.mine = placement.slots_of_rank(index)
        self.rebalances = self.moved = 0  # counters, for tests and logs
        self.tokens_per_iteration: list[int] = []  # (token, slot) pairs served here, per iteration

    def record(self, layer: int, ids: torch.Tensor) -> None:
        """ids [n, k] physical slots of tokens that reached this rank: count the local ones."""
        local = ids[(ids >= self.mine.start) & (ids < self.mine.stop)]
        self.window.record_physical(layer, local, self.placement.phy2log)

    def end_iteration(self) -> None:
        self.tokens_per_iteration.append(int(self.window.current.sum()))  # this iteration's count
        self.window.end_iteration()

    def rebalance(self) -> None:
        load = self.window.load().numpy().astype(np.int64)  # [L, N] tokens at my slots
        total = np.empty_like(load)
        req = self.comm.Iallreduce(load, total, op=MPI.SUM)
        self.control.wait(req, None, "EPLB load all-reduce among expert ranks")
        p = self.placement
        new = Placement.from_rebalance(torch.from_numpy(total).double(), p.num_replicas,
                                       self.eplb.groups_for(self.model.config),
                                       self.eplb.num_nodes, p.num_ranks)
        self._move_weights(p, new)
        self.placement = new
        self.rebalances += 1
        if self.index == 0:
            for leader in self.leaders:
                self.control.send(new.phy2log.tolist(), leader, TAG_PLACEMENT)
            log.info("%s EPLB rebalance %d: %d weight moves into this rank",
                     self.control.me, self.rebalances, self.moved)

    def _move_weights(self, old: Placement, new: Placement) -> None:
        """Stage every destination slot's new weights, then switch them in."""
        layers = self.model.layers
        moe = {i for i, layer in enumerate(layers) if layer.is_moe}  # dense layers: no experts
        moves = [mv for mv in weight_moves(old, new, self.index) if mv.layer in moe]
        sends = [mv for mv in weight_sends(old, new, self.index) if mv.layer in moe]
        S, R = old.slots_per_rank, old.num_replicas
        staged, reqs = {}, []
        for mv in sends:  # old weights of my slot src_slot go to rank mv.rank's slot dst_slot
            ex = layers[mv.layer].mlp.experts
            buf = _host(torch.cat([ex.gate_up_proj[mv.src_slot].flatten(),
                                   ex.down_proj[mv.src_slot].flatten()]))
            tag = TAG_WEIGHTS + mv.layer * R + mv.rank * S + mv.dst_slot
            reqs.append((self.comm.Isend(_np(buf), dest=mv.rank, tag=tag), mv.rank, buf))
        for mv in moves:
            ex = layers[mv.layer].mlp.experts
            gu, dn = ex.gate_up_proj[mv.dst_slot], ex.down_proj[mv.dst_slot]
            if mv.src == "self":
                staged[(mv.layer, mv.dst_slot)] = torch.cat([ex.gate_up_proj[mv.src_slot].flatten(),
                                                             ex.down_proj[mv.src_slot].flatten()])
                continue
            buf = torch.empty(gu.numel() + dn.numel(), dtype=gu.dtype)  # host staging
            tag = TAG_WEIGHTS + mv.layer * R + self.index * S + mv.dst_slot
            reqs.append((self.comm.Irecv(_np(buf), source=mv.src, tag=tag), mv.src, buf))
            staged[(mv.layer, mv.dst_slot)] = buf
        for req, peer, _ in reqs:
            self.control.wait(req, peer, "EPLB weight move")
        for (layer, slot), buf in staged.items():
            ex = layers[layer].mlp.experts
            n = ex.gate_up_proj[slot].numel()
            ex.gate_up_proj.data[slot].copy_(buf[:n].view(ex.gate_up_proj[slot].shape))
            ex.down_proj.data[slot].copy_(buf[n:].view(ex.down_proj[slot].shape))
        self.moved += sum(1 for mv in moves if not (mv.src == "self" and mv.src_slot == mv.dst_slot))


def _host(t: torch.Tensor) -> torch.Tensor:
    """Weights MPI can read: on a GPU staged through host memory (a rebalance is rare and
    waits anyway; docs/comm.md)."""
    return t.cpu() if t.is_cuda else t


def _np(t: torch.Tensor):
    """A numpy view of a host tensor; bf16/fp16 as their 16-bit patterns (numpy has no bf16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
