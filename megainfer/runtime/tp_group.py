"""Tensor parallelism inside one attention replica over MPI (CPU): sum all-reduce for o_proj,
and leader-to-peers broadcast of what only the leader computes (routed expert output, final
hidden rows). Every wait is bounded (``ControlPlane``)."""
from __future__ import annotations

import torch
from mpi4py import MPI

from .control import ControlPlane


class TPGroup:
    def __init__(self, comm: MPI.Comm, control: ControlPlane, leader_world_rank: int):
        self.comm, self.control = comm, control  # comm: this replica's TP ranks
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.leader_world_rank = leader_world_rank

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the TP ranks. t [.., H] float -> same shape, identical on every rank."""
        t = t.contiguous()
        req = self.comm.Iallreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)
        self.control.wait(req, self.leader_world_rank, "tensor-parallel all-reduce")
        return t

    def broadcast_from_leader(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """TP rank 0's t on every rank (shape must agree)."""
        t = t.contiguous()
        req = self.comm.Ibcast(t.numpy(), root=0)
        self.control.wait(req, self.leader_world_rank, f"tensor-parallel broadcast of {what}")
        return t
