"""Tensor-parallel collectives point to point over the job's device transport, so a replica's
partial sums and broadcasts stay on the GPU (``comm.tp_collectives``; docs/comm.md).

One ``Channel`` among the replica's TP ranks carries ``part [n, H]`` in the model dtype:
* all-reduce (vLLM's one-shot: each rank sends its partial to every other): every rank adds
  all partials **in TP-rank order** in float32 and rounds once, so every rank holds the same
  bits (for TP 2 the same sum as the host path's float32 MPI all-reduce);
* broadcast: TP rank 0 sends its tensor to every follower.
More than ``capacity`` rows go as several collectives in row order; another shape or dtype (a
layer's KV amax rows) takes ``TPGroup``'s MPI path, every rank deciding alike from the shape.
The header carries the collective's sequence number (a rank out of step fails the header
check); a silent peer is named by its world rank within ``comm.timeout_s`` (``RankFailure``)."""
from __future__ import annotations

from typing import Optional

import torch

from megainfer.comm.channel import Channel
from megainfer.comm.errors import CommTimeoutError
from megainfer.comm.select import device_path_kind
from megainfer.comm.spec import MessageSpec
from megainfer.comm.transport import Transport
from megainfer.comm.wait import WaitPolicy
from megainfer.runtime.control import RankFailure

MAX_MESSAGE_BYTES = 8 << 20  # the largest part sent point to point (vLLM's custom all-reduce: 8 MiB)
SEQ_MOD = 1 << 30  # the header's int32 iteration field holds the collective's sequence number


def tp_capacity(hidden: int, dtype: torch.dtype, max_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """Rows of ``[n, hidden]`` in ``dtype`` one message may carry (at least 1)."""
    return max(1, max_bytes // (hidden * torch.empty(0, dtype=dtype).element_size()))


class TPChannel:
    """Point-to-point all-reduce and broadcast among the ranks of one TP communicator.

    ``world_ranks[r]``: the job rank of TP rank ``r`` (what a timeout names). Collective to
    build (every TP rank, same order), as every channel is."""

    def __init__(self, transport: Transport, hidden: int, dtype: torch.dtype, capacity: int,
                 wait: WaitPolicy, world_ranks: list[int], me: str):
        self.transport, self.hidden, self.dtype, self.capacity = transport, hidden, dtype, capacity
        self.rank, self.size = transport.rank, transport.size
        self.world_ranks, self.me = list(world_ranks), me
        ranks = list(range(self.size))
        self.channel = Channel(transport, ranks, ranks,
                               MessageSpec.of(capacity, part=((hidden,), dtype)),
                               streams=1, depth=2, wait=wait, name="tp")
        self.seq = 0
        self.sent = 0  # collectives that went point to point (tests, logs)

    def fits(self, t: torch.Tensor) -> bool:
        """True when ``t`` goes point to point (as ``ceil(rows / capacity)`` collectives); the
        same answer on every rank for the same collective (shape and dtype agree across TP
        ranks)."""
        return t.dim() == 2 and t.shape[1] == self.hidden and t.dtype == self.dtype

    def _pieces(self, t: torch.Tensor) -> list[torch.Tensor]:
        """t [n, H] -> row pieces of at most ``capacity`` rows (one, possibly empty, at least)."""
        if t.shape[0] <= self.capacity:
            return [t]
        return list(torch.split(t, self.capacity))

    def _next(self) -> int:
        self.seq = (self.seq + 1) % SEQ_MOD
        self.sent += 1
        return self.seq

    def _recv(self, peer: int, seq: int, what: str):
        try:
            return self.channel.recv(peer, layer=0, micro_batch=0, iteration=seq).wait()
        except CommTimeoutError as e:
            raise RankFailure(self.me, self.world_ranks[peer], what, e.waited_s) from e

    def _wait_sends(self, sends: list, what: str) -> None:
        for peer, h in sends:
            try:
                h.wait()
            except CommTimeoutError as e:
                raise RankFailure(self.me, self.world_ranks[peer], what, e.waited_s) from e

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t [n, H] (this rank's partial) -> the sum over TP ranks, same bits on every rank."""
        pieces = self._pieces(t)
        if len(pieces) > 1:
            return torch.cat([self._all_reduce(p) for p in pieces])
        return self._all_reduce(t)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """One collective of at most ``capacity`` rows."""
        seq, t = self._next(), t.contiguous()
        what = "tensor-parallel all-reduce"
        sends = [(p, self.channel.send(p, iteration=seq, layer=0, micro_batch=0, part=t))
                 for p in range(self.size) if p != self.rank]
        total = None
        for r in range(self.size):  # TP-rank order: every rank adds alike
            if r == self.rank:
                x, msg = t.float(), None
            else:
                msg = self._recv(r, seq, what)
                x = msg["part"].float()
            total = x.clone() if total is None else total.add_(x)
            if msg is not None:
                msg.release()
        self._wait_sends(sends, what)
        return total.to(t.dtype)

    def broadcast_from_leader(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """TP rank 0's t [n, H] on every rank (the followers' t gives only the shape)."""
        pieces = self._pieces(t)
        if len(pieces) > 1:
            return torch.cat([self._broadcast(p, what) for p in pieces])
        return self._broadcast(t, what)

    def _broadcast(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """One broadcast of at most ``capacity`` rows."""
        seq, phase = self._next(), f"tensor-parallel broadcast of {what}"
        if self.rank == 0:
            t = t.contiguous()
            sends = [(p, self.channel.send(p, iteration=seq, layer=0, micro_batch=0, part=t))
                     for p in range(1, self.size)]
            self._wait_sends(sends, phase)
            return t
        msg = self._recv(0, seq, phase)
        out = msg["part"].clone()
        msg.release()
        return out

    def close(self) -> None:
        self.channel.close()


def tp_collectives_kind(choice: str, device: torch.device, transport: str) -> Optional[str]:
    """``comm.tp_collectives`` (auto | mpi | channel) -> the transport kind the TP channel runs
    on, or None for the host path (MPI collectives): ``comm.select.device_path_kind``."""
    return device_path_kind(choice, device, transport)
