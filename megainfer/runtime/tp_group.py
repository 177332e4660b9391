"""Tensor parallelism inside one attention replica over MPI (device tensors staged through host
memory; the CPU path is unchanged): sum all-reduce for o_proj,
and leader-to-peers broadcast of what only the leader computes (routed expert output, final
hidden rows). Every wait is bounded (``ControlPlane``)."""
from __future__ import annotations

from typing import Optional

import torch
from mpi4py import MPI

from .control import ControlPlane


def late_peer(leader: int, tp_rank: int, tp: int) -> Optional[int]:
    """The rank a timed-out TP wait names: a follower waits on the leader; the leader of a pair
    on its one follower; a leader of three or more cannot tell which one is late (None: "a peer
    rank"). TP ranks of a replica are consecutive from ``leader``."""
    if tp_rank:
        return leader
    return leader + 1 if tp == 2 else None


class TPGroup:
    def __init__(self, comm: MPI.Comm, control: ControlPlane, leader_world_rank: Optional[int]):
        """``leader_world_rank``: the rank a late collective names (``late_peer``)."""
        self.comm, self.control = comm, control  # comm: this replica's TP ranks
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.leader_world_rank = leader_world_rank

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the TP ranks. t [.., H] float -> same shape, identical on every rank
        (bf16/fp16 are summed in fp32, then rounded once)."""
        h = _host(t.float() if t.dtype in (torch.bfloat16, torch.float16) else t)
        req = self.comm.Iallreduce(MPI.IN_PLACE, h.numpy(), op=MPI.SUM)
        self.control.wait(req, self.leader_world_rank, "tensor-parallel all-reduce")
        return h.to(t.device, t.dtype, non_blocking=True)

    def broadcast_from_leader(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """TP rank 0's t on every rank (shape must agree)."""
        h = _host(t)
        bits = h.view(torch.int16) if h.dtype == torch.bfloat16 else h  # numpy has no bf16
        req = self.comm.Ibcast(bits.numpy(), root=0)
        self.control.wait(req, self.leader_world_rank, f"tensor-parallel broadcast of {what}")
        return h.to(t.device, non_blocking=True)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor MPI can read and write: t itself on cpu, a staged copy of a
    device tensor (waits for the device: TP on GPUs goes through host staging, docs/comm.md)."""
    t = t.contiguous()
    return t.cpu() if t.is_cuda else t
