"""Live EPLB: rebalance expert placement at an iteration boundary, without a restart.

Every ``eplb.interval`` iterations, before the iteration's first message, each replica leader
sends every expert rank a REBALANCE control message on the dispatch channel. The expert ranks
sum their load windows, all compute the same new placement (``Placement.from_rebalance`` is
deterministic), move weights point to point into fresh buffers and switch them in; expert rank
0 sends the new ``phy2log`` to the leaders, which switch their replica choice before sending
the iteration's tokens. Invariant: physical slots stay on their rank, so ``expert_map`` never
changes, only which logical expert a slot holds. Weight moves go device to device
(``weight_channel.py``) or staged through the host over MPI (``comm.eplb_moves``).
docs/eplb.md, "Live rebalancing (`megainfer/runtime/eplb/rebalancer.py`)"."""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch
from mpi4py import MPI

from megainfer.comm.spec import KIND_REBALANCE
from megainfer.config import EplbConfig
from megainfer.eplb import ExpertLoadWindow, Placement, weight_moves
from megainfer.runtime import tags
from megainfer.runtime.control import ControlPlane
from megainfer.runtime.eplb.weight_channel import Inbound, Outbound, run_moves, world_ranks_of
from megainfer.runtime.messages import PlacementUpdate

log = logging.getLogger("megainfer.runtime")


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
        update = self.control.recv(self.expert0, tags.EPLB_PLACEMENT, "EPLB placement hand-over")
        self.placement = Placement.from_phy2log(torch.tensor(update.phy2log),
                                                self.placement.num_experts,
                                                self.placement.num_ranks)


class ExpertRebalancer:
    """Expert rank side: the load window, the agreement, the weight moves."""

    def __init__(self, model, placement: Placement, index: int, expert_comm: MPI.Comm,
                 control: ControlPlane, leaders: list[int], eplb: EplbConfig,
                 moves: Optional[str] = None):
        """``moves``: the transport kind weights move on device to device
        (``weight_channel.eplb_moves_kind``), None for host staging over MPI."""
        self.model, self.placement, self.index, self.moves = model, placement, index, moves
        self.comm, self.control, self.leaders, self.eplb = expert_comm, control, leaders, eplb
        dev = next(layer for layer in model.layers if layer.is_moe).mlp.experts.gate_up_proj.device
        # counted where the ids are (no host sync per (layer, micro-batch) on a GPU)
        self.window = ExpertLoadWindow(placement.num_layers, placement.num_experts, eplb.window,
                                       device=dev)
        self._phy2log = placement.phy2log.to(dev)  # [L, R], refreshed with the placement
        self.mine = placement.slots_of_rank(index)
        self.rebalances = self.moved = 0  # counters, for tests and logs
        self.device_messages = 0  # weight messages sent over the device path (tests, logs)
        self.world = world_ranks_of(expert_comm)  # expert index -> job rank (failures name it)
        # (token, slot) pairs served here, per iteration: on the device (grown by doubling, 8 bytes
        # an iteration), the first ``_read`` of them also read back to ``_counted``
        self._counts = torch.zeros(64, dtype=torch.int64, device=dev)
        self._n = self._read = 0
        self._counted: list[int] = []

    def record(self, layer: int, ids: torch.Tensor) -> None:
        """ids [n, k] physical slots of tokens that reached this rank: count the local ones,
        by logical expert. Masked by weight, not by indexing, so nothing waits for the device."""
        flat = ids.reshape(-1).long()  # [n*k]
        local = (flat >= self.mine.start) & (flat < self.mine.stop)
        logical = self._phy2log[layer][flat.clamp(0, self._phy2log.shape[1] - 1)]
        self.window.record(layer, logical, weights=local)

    def end_iteration(self) -> None:
        if self._n == self._counts.numel():
            self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
        self._counts[self._n] = self.window.current.sum()  # this iteration's count, on the device
        self._n += 1
        self.window.end_iteration()

    @property
    def tokens_per_iteration(self) -> list[int]:
        """(token, slot) pairs served here, per iteration so far (one device read per call)."""
        if self._read < self._n:
            self._counted += self._counts[self._read:self._n].tolist()
            self._read = self._n
        return self._counted

    def rebalance(self) -> None:
        load = self.window.load().cpu().numpy().astype(np.int64)  # [L, N] tokens at my slots
        total = np.empty_like(load)
        req = self.comm.Iallreduce(load, total, op=MPI.SUM)
        self.control.wait(req, None, "EPLB load all-reduce among expert ranks")
        p = self.placement
        new = Placement.from_rebalance(torch.from_numpy(total).double(), p.num_replicas,
                                       self.eplb.groups_for(self.model.config),
                                       self.eplb.num_nodes, p.num_ranks)
        self._move_weights(p, new)
        self.placement, self._phy2log = new, new.phy2log.to(self._phy2log.device)
        self.rebalances += 1
        if self.index == 0:
            for leader in self.leaders:
                self.control.send(PlacementUpdate(new.phy2log.tolist()), leader,
                                  tags.EPLB_PLACEMENT)
            log.info("%s EPLB rebalance %d: %d weight moves into this rank",
                     self.control.me, self.rebalances, self.moved)

    def _move_weights(self, old: Placement, new: Placement) -> None:
        """Stage every destination slot's new weights, then switch them in."""
        moe = {i for i, layer in enumerate(self.model.layers) if layer.is_moe}  # dense: no experts
        per = [[mv for mv in weight_moves(old, new, r) if mv.layer in moe]  # every rank's, once
               for r in range(old.num_ranks)]
        moves = per[self.index]
        sends = [mv for r, ms in enumerate(per) if r != self.index  # as eplb.weight_sends orders
                 for mv in ms if mv.src == self.index]
        if self.moves and any(mv.src != "self" for ms in per for mv in ms):  # every rank alike
            staged = self._stage_device(old, moves, sends)
        else:
            staged = self._stage_host(old, moves, sends)
        install_staged(self.model, staged)
        self.moved += sum(1 for mv in moves if not (mv.src == "self" and mv.src_slot == mv.dst_slot))

    def _stage_device(self, old: Placement, moves, sends) -> dict:
        """Device to device: old slots' weights sent from the parameters, received into device
        buffers, over a transport built for this rebalance (docs/eplb.md)."""
        layers = self.model.layers
        outs = [Outbound(mv.rank, mv.layer, mv.dst_slot, _parts(layers[mv.layer].mlp.experts,
                                                                mv.src_slot)) for mv in sends]
        staged, ins = {}, []
        for mv in moves:
            ex = layers[mv.layer].mlp.experts
            if mv.src == "self":
                staged[(mv.layer, mv.dst_slot)] = _flat(ex, mv.src_slot)
                continue
            buf = empty_slot(ex, mv.dst_slot, ex.gate_up_proj.device)
            ins.append(Inbound(mv.src, mv.layer, mv.dst_slot, buf))
            staged[(mv.layer, mv.dst_slot)] = buf
        ex0 = next(layer for layer in layers if layer.is_moe).mlp.experts
        ranks = list(range(old.num_ranks))
        self.device_messages += run_moves(self.moves, self.comm, ex0.gate_up_proj.device,
                                          move_dtype(ex0), ranks, ranks,
                                          self.control, self.world, "EPLB weight move", outs, ins)
        return staged

    def _stage_host(self, old: Placement, moves, sends) -> dict:
        """Through host memory over MPI: one Isend/Irecv of a host buffer per move."""
        layers = self.model.layers
        S, R = old.slots_per_rank, old.num_replicas
        staged, reqs = {}, []
        for mv in sends:  # old weights of my slot src_slot go to rank mv.rank's slot dst_slot
            buf = _host(_flat(layers[mv.layer].mlp.experts, mv.src_slot))
            tag = tags.EPLB_WEIGHTS + mv.layer * R + mv.rank * S + mv.dst_slot
            reqs.append((self.comm.Isend(_np(buf), dest=mv.rank, tag=tag), mv.rank, buf))
        for mv in moves:
            ex = layers[mv.layer].mlp.experts
            if mv.src == "self":
                staged[(mv.layer, mv.dst_slot)] = _flat(ex, mv.src_slot)
                continue
            buf = empty_slot(ex, mv.dst_slot)  # host staging
            tag = tags.EPLB_WEIGHTS + mv.layer * R + self.index * S + mv.dst_slot
            reqs.append((self.comm.Irecv(_np(buf), source=mv.src, tag=tag), mv.src, buf))
            staged[(mv.layer, mv.dst_slot)] = buf
        for req, peer, _ in reqs:
            self.control.wait(req, self.world[peer], "EPLB weight move")
        return staged


def install_staged(model, staged: dict) -> None:
    """Switch staged weights in: {(layer, slot): flat buffer (gate_up, then down; quantised
    experts: the stored bytes of gate_up, down, then their scales)}."""
    for (layer, slot), buf in staged.items():
        ex = model.layers[layer].mlp.experts
        at = 0
        for dst in ex.slot_tensors(slot):
            n = dst.numel() if not ex.quantised else dst.numel() * dst.element_size()
            src = buf[at:at + n]
            dst.copy_(src.view(dst.shape) if not ex.quantised else
                      src.view(dst.dtype).view(dst.shape))
            at += n
        ex.slot_written(slot)


def move_dtype(ex) -> torch.dtype:
    """What a slot's weights travel as: their dtype, or bytes (uint8) for quantised experts,
    whose stored tensors and scales differ in dtype."""
    return torch.uint8 if ex.quantised else ex.gate_up_proj.dtype


def _parts(ex, slot: int) -> tuple:
    """A slot's weights in the order they travel (gate_up, then down; quantised: then their
    scales, as bytes), read in place."""
    parts = ex.slot_tensors(slot)
    return tuple(t.view(torch.uint8).reshape(-1) if ex.quantised else t for t in parts)


def empty_slot(ex, slot: int, device="cpu") -> torch.Tensor:
    """An uninitialised flat buffer the size of one slot's weights (gate_up, then down; quantised
    experts: their stored bytes and scales), in ``move_dtype`` on ``device`` (host staging by
    default): where a moved slot is received."""
    parts = ex.slot_tensors(slot)
    n = sum(t.numel() * (t.element_size() if ex.quantised else 1) for t in parts)
    return torch.empty(n, dtype=move_dtype(ex), device=device)


def _flat(ex, slot: int) -> torch.Tensor:
    """A slot's weights as one fresh flat buffer on their device (``_parts`` concatenated)."""
    return torch.cat([t.flatten() for t in _parts(ex, slot)])


def _host(t: torch.Tensor) -> torch.Tensor:
    """Weights MPI can read: on a GPU staged through host memory (a rebalance is rare and
    waits anyway; docs/comm.md)."""
    return t.cpu() if t.is_cuda else t


def _np(t: torch.Tensor):
    """A numpy view of a host tensor; bf16/fp16 as their 16-bit patterns (numpy has no bf16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
