"""MPI transport: mpi4py persistent requests on pre-allocated CPU (numpy-backed) buffers.

No pickling and no buffer allocation per message. Each slot binds its buffer and peer once
(``send_init``/``recv_init``); a message is then one ``MPI_Start`` of a persistent request
made by ``Send_init``/``Recv_init`` the first time that (byte count, tag) is used, and kept.
A send slot keeps at most ``MAX_PERSISTENT`` of them (row counts vary per message); beyond
that it falls back to a plain ``Isend``. The communicator is duplicated so channel tags
never meet the application's.
"""
from __future__ import annotations

from functools import partial

import torch
from mpi4py import MPI

from megainfer.comm.transport import Buffer, TransportRequest, Transport, host_buffer

MAX_PERSISTENT = 64  # persistent sends kept per send slot, one per (nbytes, tag) seen


class _MpiSend(TransportRequest):
    """A send request. ``test`` is mpi4py's own ``Test`` (no Python frame per poll): it stays
    True once complete (a finished request turns null; an inactive persistent one is done)."""

    __slots__ = ("req", "test")

    def __init__(self, req: MPI.Request):
        self.req, self.test = req, req.Test

    def cancel(self) -> None:
        if not self.req.Test():
            self.req.Cancel()
            self.req.Wait()


class _MpiRecv(TransportRequest):
    """A receive request; ``test`` is ``Test`` with the status kept for ``received_nbytes``."""

    __slots__ = ("req", "status", "test")

    def __init__(self, req: MPI.Request):
        self.req, self.status = req, MPI.Status()
        self.test = partial(req.Test, self.status)

    def received_nbytes(self) -> int:
        return self.status.Get_count(MPI.BYTE)

    def cancel(self) -> None:
        if not self.req.Test():
            self.req.Cancel()
            self.req.Wait()


class _MpiSendInit:
    """One send slot's persistent sends, keyed by (nbytes, tag); the last one used is kept
    at hand (a slot mostly sends the same size on the same tag) and matched field by field,
    so the common case allocates nothing."""

    __slots__ = ("transport", "buf", "np", "peer", "reqs", "nbytes", "tag", "last")

    def __init__(self, t: "MpiTransport", buf: Buffer, peer: int):
        self.transport, self.buf, self.np, self.peer, self.reqs = t, buf, buf.extra["np"], peer, {}
        self.nbytes, self.tag, self.last = -1, -1, None

    def start(self, nbytes: int, tag: int) -> TransportRequest:
        if nbytes == self.nbytes and tag == self.tag:
            r = self.last
        else:
            r = self.reqs.get((nbytes, tag))
            if r is None:
                if len(self.reqs) >= MAX_PERSISTENT:  # a slot that met too many sizes
                    return self.transport.isend(self.buf, nbytes, self.peer, tag)
                pre = self.transport.comm.Send_init([self.np, nbytes, MPI.BYTE], self.peer, tag)
                self.transport._persistent.append(pre)
                r = self.reqs[(nbytes, tag)] = _MpiSend(pre)
            self.nbytes, self.tag, self.last = nbytes, tag, r
        r.req.Start()
        return r


class _MpiRecvInit:
    """One receive slot's persistent receive (a slot always receives on the same tag)."""

    __slots__ = ("transport", "np", "peer", "key", "recv_req")

    def __init__(self, t: "MpiTransport", buf: Buffer, peer: int):
        self.transport, self.np, self.peer = t, buf.extra["np"], peer
        self.key, self.recv_req = None, None

    def start(self, nbytes: int, tag: int) -> TransportRequest:
        r = self.recv_req
        if r is None or nbytes != self.key[0] or tag != self.key[1]:  # no tuple per message
            pre = self.transport.comm.Recv_init([self.np, nbytes, MPI.BYTE], self.peer, tag)
            self.transport._persistent.append(pre)
            r = self.recv_req = _MpiRecv(pre)
            self.key = (nbytes, tag)
        r.req.Start()
        return r


class MpiTransport(Transport):
    def __init__(self, comm: MPI.Comm):
        super().__init__()
        self.comm = comm.Dup()  # collective: every rank of comm builds its transport
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.device = torch.device("cpu")
        self._persistent: list[MPI.Prequest] = []

    def alloc(self, nbytes: int) -> Buffer:
        buf = host_buffer(nbytes)
        buf.extra = {"np": buf.data.numpy()}
        return buf

    def isend(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> TransportRequest:
        return _MpiSend(self.comm.Isend([buf.extra["np"], nbytes, MPI.BYTE], peer, tag))

    def irecv(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> TransportRequest:
        return _MpiRecv(self.comm.Irecv([buf.extra["np"], nbytes, MPI.BYTE], peer, tag))

    def send_init(self, buf: Buffer, peer: int) -> _MpiSendInit:
        return _MpiSendInit(self, buf, peer)

    def recv_init(self, buf: Buffer, peer: int) -> _MpiRecvInit:
        return _MpiRecvInit(self, buf, peer)

    def progress(self) -> None:
        self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def close(self) -> None:
        for pre in self._persistent:
            pre.Free()
        self._persistent.clear()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
