"""Expert weight moves device to device: (layer, slot) weights between expert ranks as
fixed-capacity messages over the job's device transport (``comm.eplb_moves``). Live EPLB
(``rebalancer.py``) and a re-plan (``replan/weights.py``) use it.

Invariants: a slot's weights are sent straight from the parameters (``gate_up_proj`` then
``down_proj``) in messages of at most ``CHUNK_BYTES``; the caller switches the received buffers
in once every move is done. Every rank builds the same schedule (round ``d``: send to
``rank + d``, receive from ``rank - d``, mod n; a pair's moves in (layer, slot) order; the
header carries (layer, slot, chunk)). The transport lives for one set of moves; every wait is
bounded from the last message that moved and a silent peer is named (``RankFailure``).
docs/eplb.md, "Where the bytes go (`comm.eplb_moves`)"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megainfer.comm import make_transports
from megainfer.comm.channel import Channel
from megainfer.comm.errors import CommTimeoutError
from megainfer.comm.select import device_path_kind
from megainfer.comm.spec import MessageSpec
from megainfer.comm.transport import Transport
from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.runtime.control import RankFailure

CHUNK_BYTES = 8 << 20  # the largest message (vLLM's custom all-reduce size, the TP channel's)
ROW = 1024  # elements per message row (the row count stays small: the channel tabulates it)
DEPTH = 2  # messages in flight per (sender, receiver)


@dataclass(frozen=True)
class Outbound:
    """One move this rank sends: ``parts`` (device tensors, read in place, flattened and
    concatenated) to transport rank ``peer``'s ``slot`` of ``layer``."""
    peer: int
    layer: int
    slot: int
    parts: tuple


@dataclass(frozen=True)
class Inbound:
    """One move this rank receives from transport rank ``peer`` into ``out`` (flat, device)."""
    peer: int
    layer: int
    slot: int
    out: torch.Tensor


def eplb_moves_kind(choice: str, device: torch.device, transport: str) -> Optional[str]:
    """``comm.eplb_moves`` (auto | mpi | device) -> the transport kind the weight moves run on,
    or None for the host path (MPI through host memory): ``comm.select.device_path_kind``."""
    return device_path_kind(choice, device, transport)


def n_chunks(numel: int, per_message: int) -> int:
    """Messages one move of ``numel`` elements takes (at least one)."""
    return max(1, -(-numel // per_message))


class WeightChannel:
    """Moves between the ranks of one transport. ``world_ranks[r]``: the job rank of transport
    rank ``r`` (what a timeout names); ``senders``/``receivers``: transport ranks with moves
    out / in (every rank builds it, in the same order)."""

    def __init__(self, transport: Transport, dtype: torch.dtype, senders: list[int],
                 receivers: list[int], wait: WaitPolicy, world_ranks: list[int], me: str,
                 what: str, chunk_bytes: int = CHUNK_BYTES, row: int = ROW):
        self.transport, self.dtype, self.row = transport, dtype, row
        self.rank, self.size = transport.rank, transport.size
        self.world_ranks, self.me, self.what = list(world_ranks), me, what
        rows = max(1, chunk_bytes // (row * torch.empty(0, dtype=dtype).element_size()))
        self.per_message = rows * row  # elements
        self.channel = Channel(transport, senders, receivers,
                               MessageSpec.of(rows, w=((row,), dtype)),
                               streams=1, depth=DEPTH, wait=wait, name="weights")
        self.sent = self.received = 0  # messages over the transport (tests, logs)

    def _fail(self, peer: int, e: CommTimeoutError):
        return RankFailure(self.me, self.world_ranks[peer], self.what, e.waited_s)

    def _post(self, mv: Outbound, c: int):
        lo = c * self.per_message
        hi = min(lo + self.per_message, sum(p.numel() for p in mv.parts))
        rows = -(-(hi - lo) // self.row)
        try:
            out = self.channel.reserve(mv.peer, rows)
        except CommTimeoutError as e:
            raise self._fail(mv.peer, e) from e
        _fill(out.views(rows)["w"].view(-1), mv.parts, lo, hi)
        self.sent += 1
        return self.channel.post(out, iteration=c, layer=mv.layer, micro_batch=mv.slot)

    def _take(self, mv: Inbound, c: int, msg) -> None:
        lo = c * self.per_message
        hi = min(lo + self.per_message, mv.out.numel())
        mv.out[lo:hi].copy_(msg.wait()["w"].reshape(-1)[:hi - lo])
        msg.release()
        self.received += 1

    def _round(self, dst: int, send: list, src: int, recv: list) -> None:
        """Post every (move, chunk) of ``send`` to ``dst`` as its ring frees, take every one of
        ``recv`` from ``src`` as it arrives; fail when neither made progress for a timeout."""
        handles, msg, state = [], None, [0, 0]  # messages posted, taken

        def step() -> bool:
            nonlocal msg
            si, ri = state
            moved = False
            while si < len(send) and (si < DEPTH or handles[si - DEPTH].test()):
                handles.append(self._post(*send[si]))  # the slot is free: reserve does not wait
                si, moved = si + 1, True
            while ri < len(recv):
                mv, c = recv[ri]
                if msg is None:
                    msg = self.channel.recv(mv.peer, layer=mv.layer, micro_batch=mv.slot,
                                            iteration=c)
                if not msg.test():
                    break
                self._take(mv, c, msg)
                msg, ri, moved = None, ri + 1, True
            state[:] = si, ri
            return moved or (si == len(send) and ri == len(recv))
        while state[0] < len(send) or state[1] < len(recv):
            waited = wait_until(step, self.channel.policy)  # bounded since the last progress
            if waited < 0:
                late = src if state[1] < len(recv) else dst
                raise RankFailure(self.me, self.world_ranks[late], self.what, -waited)
        for h in handles:
            try:
                h.wait()
            except CommTimeoutError as e:
                raise self._fail(dst, e) from e

    def exchange(self, outs: list[Outbound], ins: list[Inbound]) -> None:
        """Send every ``outs``, fill every ``ins``; returns once all arrived and all left."""
        for mv in ins:
            if mv.out.dtype != self.dtype or mv.out.dim() != 1:
                raise ValueError(f"{self.me}: weight move into layer {mv.layer} slot {mv.slot}: "
                                 f"need a flat {self.dtype} buffer, got {tuple(mv.out.shape)} "
                                 f"{mv.out.dtype}")
        key = lambda mv: (mv.layer, mv.slot)  # noqa: E731 -- the pair's order, on both sides
        n, me = self.size, self.rank
        for d in range(1, n):
            dst, src = (me + d) % n, (me - d) % n
            send = [(mv, c) for mv in sorted((m for m in outs if m.peer == dst), key=key)
                    for c in range(n_chunks(sum(p.numel() for p in mv.parts), self.per_message))]
            recv = [(mv, c) for mv in sorted((m for m in ins if m.peer == src), key=key)
                    for c in range(n_chunks(mv.out.numel(), self.per_message))]
            if send or recv:
                self._round(dst, send, src, recv)

    def close(self) -> None:
        self.channel.close()
        self.transport.close()


def _fill(dst: torch.Tensor, parts, lo: int, hi: int) -> None:
    """dst[: hi - lo] <- elements [lo, hi) of the flattened concatenation of ``parts``."""
    off = 0
    for p in parts:
        f = p.detach().reshape(-1)
        a, b = max(lo, off), min(hi, off + f.numel())
        if a < b:
            dst[a - lo:b - lo].copy_(f[a - off:b - off])
        off += f.numel()


def open_weight_channel(kind: str, comm, device, dtype: torch.dtype, senders: list[int],
                        receivers: list[int], control, world_ranks: list[int], what: str,
                        **kw) -> tuple[WeightChannel, object]:
    """Collective over ``comm``: the transport ``kind`` and the channel on it, each collective
    call bounded by the control plane's timeout and naming a late rank. Returns the channel
    and the bounded communicator its ``close`` must go through (``close_weight_channel``)."""
    from megainfer.runtime.bounded import BoundedComm
    bounded = BoundedComm(comm, control.me, control.policy, what)

    def build():
        transport, _ = make_transports(kind, bounded, device=device)
        return WeightChannel(transport, dtype, senders, receivers, control.policy, world_ranks,
                             control.me, what, **kw)
    return bounded.call("weight channel set-up", build, scale=2.0), bounded


def close_weight_channel(wc: WeightChannel, bounded) -> None:
    """Collective: the channel's receives cancelled, the transport closed (bounded by twice the
    timeout: a rank whose moves ended early waits here for the others' last messages)."""
    bounded.call("weight channel closed", wc.close, scale=2.0)


def run_moves(kind: str, comm, device, dtype: torch.dtype, senders: list[int],
              receivers: list[int], control, world_ranks: list[int], what: str,
              outs: list[Outbound], ins: list[Inbound]) -> int:
    """Collective: a channel opened for these moves, ``outs`` sent and ``ins`` filled, the
    channel closed. Returns the messages this rank sent over the transport."""
    wc, bounded = open_weight_channel(kind, comm, device, dtype, senders, receivers, control,
                                      world_ranks, what)
    wc.exchange(outs, ins)
    close_weight_channel(wc, bounded)
    return wc.sent


def world_ranks_of(comm) -> list[int]:
    """Job rank of every rank of ``comm`` (what a failure names)."""
    from mpi4py import MPI
    return list(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                          MPI.COMM_WORLD.Get_group()))
