"""In-process transport: several "ranks" as objects in one process, for unit tests.

Matching follows MPI: per (src, dst, tag) FIFO, a send completes when a receive takes it.
A lock makes it usable from threads (one thread per fake rank) as well as from one thread.
"""
from __future__ import annotations

import threading
from collections import defaultdict, deque

import torch

from megainfer.comm.errors import MessageTooLargeError
from megainfer.comm.transport import Buffer, TransportRequest, Transport, host_buffer


class _LoopRequest(TransportRequest):
    __slots__ = ("done", "nbytes", "queue", "lock")

    def __init__(self):
        self.done, self.nbytes, self.queue, self.lock = False, -1, None, None

    def test(self) -> bool:
        return self.done

    def received_nbytes(self) -> int:
        return self.nbytes

    def cancel(self) -> None:
        if self.queue is None:
            return
        with self.lock:
            for entry in list(self.queue):
                if entry[2] is self:
                    self.queue.remove(entry)


class LoopbackFabric:
    """The shared wire; ``endpoint(r)`` is rank r's transport."""

    def __init__(self, size: int):
        self.size = size
        self.lock = threading.Lock()
        self.sends = defaultdict(deque)  # (src, dst, tag) -> deque[(buf, nbytes, req)]
        self.recvs = defaultdict(deque)  # (src, dst, tag) -> deque[(buf, nbytes, req)]
        self.endpoints = [LoopbackTransport(self, r) for r in range(size)]

    def endpoint(self, rank: int) -> "LoopbackTransport":
        return self.endpoints[rank]

    @staticmethod
    def _deliver(send, recv) -> None:
        sbuf, snb, sreq = send
        rbuf, rnb, rreq = recv
        if snb > rnb:
            raise MessageTooLargeError(f"loopback: {snb}-byte message into a {rnb}-byte receive")
        rbuf.data[:snb].copy_(sbuf.data[:snb])  # [snb] uint8
        rreq.nbytes, rreq.done, sreq.done = snb, True, True


class LoopbackTransport(Transport):
    def __init__(self, fabric: LoopbackFabric, rank: int):
        super().__init__()
        self.fabric, self.rank, self.size = fabric, rank, fabric.size
        self.device = torch.device("cpu")

    def alloc(self, nbytes: int) -> Buffer:
        return host_buffer(nbytes)

    def isend(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> TransportRequest:
        req, f = _LoopRequest(), self.fabric
        with f.lock:
            recvs = f.recvs[(self.rank, peer, tag)]
            if recvs:
                f._deliver((buf, nbytes, req), recvs.popleft())
            else:
                req.queue, req.lock = f.sends[(self.rank, peer, tag)], f.lock
                req.queue.append((buf, nbytes, req))
        return req

    def irecv(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> TransportRequest:
        req, f = _LoopRequest(), self.fabric
        with f.lock:
            sends = f.sends[(peer, self.rank, tag)]
            if sends:
                f._deliver(sends.popleft(), (buf, nbytes, req))
            else:
                req.queue, req.lock = f.recvs[(peer, self.rank, tag)], f.lock
                req.queue.append((buf, nbytes, req))
        return req
