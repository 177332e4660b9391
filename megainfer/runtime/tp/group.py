"""Tensor parallelism inside one attention replica: sum all-reduce for o_proj, and
leader-to-peers broadcast of what only the leader computes (routed expert output, final hidden
rows). Two paths: MPI collectives on host memory (device tensors staged through it; the CPU
default), and, with a ``TPChannel`` (``comm.tp_collectives``), point to point over the device
transport for every tensor the channel takes (docs/comm.md). Every wait is bounded."""
from __future__ import annotations

from typing import Optional

import torch
from mpi4py import MPI

from megainfer.comm import make_transports
from megainfer.runtime.control import ControlPlane
from megainfer.runtime.tp.channel import TPChannel, tp_capacity, tp_collectives_kind


def late_peer(leader: int, tp_rank: int, tp: int) -> Optional[int]:
    """The rank a timed-out TP wait names: a follower waits on the leader; the leader of a pair
    on its one follower; a leader of three or more cannot tell which one is late (None: "a peer
    rank"). TP ranks of a replica are consecutive from ``leader``."""
    if tp_rank:
        return leader
    return leader + 1 if tp == 2 else None


class TPGroup:
    def __init__(self, comm: MPI.Comm, control: ControlPlane, leader_world_rank: Optional[int],
                 channel: Optional[TPChannel] = None):
        """``leader_world_rank``: the rank a late host collective names (``late_peer``);
        ``channel``: the device path, taken by every tensor it ``fits``."""
        self.comm, self.control = comm, control  # comm: this replica's TP ranks
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.leader_world_rank, self.channel = leader_world_rank, channel

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the TP ranks. t [.., H] float -> same shape, identical on every rank
        (bf16/fp16 are summed in fp32, then rounded once)."""
        if self.channel is not None and self.channel.fits(t):
            return self.channel.all_reduce(t)
        h = _host(t.float() if t.dtype in (torch.bfloat16, torch.float16) else t)
        req = self.comm.Iallreduce(MPI.IN_PLACE, h.numpy(), op=MPI.SUM)
        self.control.wait(req, self.leader_world_rank, "tensor-parallel all-reduce")
        return h.to(t.device, t.dtype, non_blocking=True)

    def broadcast_from_leader(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """TP rank 0's t on every rank (shape must agree)."""
        if self.channel is not None and self.channel.fits(t):
            return self.channel.broadcast_from_leader(t, what)
        h = _host(t)
        bits = h.view(torch.int16) if h.dtype == torch.bfloat16 else h  # numpy has no bf16
        req = self.comm.Ibcast(bits.numpy(), root=0)
        self.control.wait(req, self.leader_world_rank, f"tensor-parallel broadcast of {what}")
        return h.to(t.device, non_blocking=True)


def make_tp_group(comm: MPI.Comm, control: ControlPlane, leader_world_rank: Optional[int],
                  job, dtype: torch.dtype, first_world_rank: int, closers: list) -> TPGroup:
    """A replica's TP group (collective over ``comm``, its TP ranks, world ranks consecutive
    from ``first_world_rank``), with the device channel ``comm.tp_collectives`` asks for; what
    must be closed at the end goes on ``closers``."""
    kind = tp_collectives_kind(job.comm.tp_collectives, job.device.torch_device, job.comm.transport)
    if kind is None or comm.Get_size() == 1:
        return TPGroup(comm, control, leader_world_rank)
    transport, _ = make_transports(kind, comm, device=job.device.torch_device)
    H = job.model.hidden_size
    ch = TPChannel(transport, H, dtype, tp_capacity(H, dtype), control.policy,
                   [first_world_rank + r for r in range(comm.Get_size())], control.me)
    closers += [ch.close, transport.close]
    return TPGroup(comm, control, leader_world_rank, ch)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor MPI can read and write: t itself on cpu, a staged copy of a
    device tensor (waits for the device: TP on GPUs goes through host staging, docs/comm.md)."""
    t = t.contiguous()
    return t.cpu() if t.is_cuda else t
