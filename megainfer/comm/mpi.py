"""MPI transport: mpi4py ``Isend`` / persistent ``Recv_init`` on CPU tensor buffers.

No pickling and no buffer allocation per message: a send passes ``[numpy view, nbytes, BYTE]``
of the slot's buffer; each receive slot owns a persistent request re-armed with ``Start``.
The communicator is duplicated so channel tags never meet the application's.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from megainfer.comm.transport import Buffer, Request, Transport, host_buffer


class _MpiSend(Request):
    __slots__ = ("req", "done")

    def __init__(self, req: MPI.Request):
        self.req, self.done = req, False

    def test(self) -> bool:
        if not self.done:
            self.done = self.req.Test()
        return self.done

    def cancel(self) -> None:
        if not self.done:
            self.req.Cancel()
            self.req.Wait()
            self.done = True


class _MpiRecv(Request):
    """Persistent receive bound to one buffer, peer and tag; ``start`` re-arms it."""

    __slots__ = ("req", "status", "done")

    def __init__(self, req: MPI.Prequest):
        self.req, self.status, self.done = req, MPI.Status(), True

    def start(self) -> "_MpiRecv":
        self.done = False
        self.req.Start()
        return self

    def test(self) -> bool:
        if not self.done:
            self.done = self.req.Test(self.status)
        return self.done

    def received_nbytes(self) -> int:
        return self.status.Get_count(MPI.BYTE)

    def cancel(self) -> None:
        if not self.done:
            self.req.Cancel()
            self.req.Wait()
            self.done = True


class MpiTransport(Transport):
    def __init__(self, comm: MPI.Comm):
        super().__init__()
        self.comm = comm.Dup()  # collective: every rank of comm builds its transport
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.device = torch.device("cpu")
        self._persistent: list[MPI.Prequest] = []

    def alloc(self, nbytes: int) -> Buffer:
        buf = host_buffer(nbytes)
        buf.extra = {"np": buf.data.numpy(), "recv": {}}
        return buf

    def isend(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> Request:
        return _MpiSend(self.comm.Isend([buf.extra["np"], nbytes, MPI.BYTE], peer, tag))

    def irecv(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> Request:
        key = (nbytes, peer, tag)
        rq = buf.extra["recv"].get(key)
        if rq is None:  # first use of this slot: build its persistent request once
            pre = self.comm.Recv_init([buf.extra["np"], nbytes, MPI.BYTE], peer, tag)
            self._persistent.append(pre)
            rq = buf.extra["recv"][key] = _MpiRecv(pre)
        return rq.start()

    def progress(self) -> None:
        self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def close(self) -> None:
        for pre in self._persistent:
            pre.Free()
        self._persistent.clear()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
