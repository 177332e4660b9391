"""The two ends of a CUDA IPC ring slot and their requests (``CudaIpcTransport``'s protocol:
see megainfer.comm.cuda_ipc). A ``RecvSlot`` owns a receive buffer and its consumed event and
sends grants; a ``SendSlot`` fences the caller's stream and queues sends on the transport."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch
from mpi4py import MPI

from megainfer.comm.errors import CommError
from megainfer.comm.transport import Buffer, TransportRequest

if TYPE_CHECKING:
    from megainfer.comm.cuda_ipc import CudaIpcTransport


def _cur(device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


class Recv(TransportRequest):
    __slots__ = ("io", "mpi", "done")

    def __init__(self, io, mpi):
        self.io, self.mpi, self.done = io, mpi, False

    def test(self) -> bool:
        if self.done:
            return True
        t = self.io.transport
        if t._queued or t.due:
            t.progress()
        if not self.mpi.Test():
            return False
        if not t.host_sync:  # host-fenced: the sender sent the header after its copy completed
            t.rt.check(t.rt.streamWaitEvent(_cur(t.device), self.io.ready, 0),
                       "cudaStreamWaitEvent")
        self.done = True
        return True

    def cancel(self) -> None:
        if not self.done and not self.mpi.Test():
            self.mpi.Cancel()
            self.mpi.Wait()


class RecvSlot:
    """One receive slot: its buffer, consumed event (ours), ready event (the sender's)."""

    def __init__(self, t: "CudaIpcTransport", buf: Buffer, peer: int):
        self.transport, self.buf, self.peer, self.tag = t, buf, peer, None
        self.consumed = t._event(ipc=True)
        self.ready = None  # opened at connect
        self.grant = np.zeros(1, dtype=np.int32)
        self.grant_req = None
        self.n = 0

    def start(self, nbytes: int, tag: int) -> TransportRequest:
        t = self.transport
        if self.tag is None:  # first post: this slot joins ring (peer, tag) in post order
            self.tag = tag
            t._new_rings.setdefault((self.peer, tag), []).append(self)
        rt = t.rt
        rt.check(rt.eventRecord(self.consumed, _cur(t.device)), "cudaEventRecord(consumed)")
        req = t.comm.Irecv([self.buf.header, MPI.INT], self.peer, tag)
        if t.host_sync:  # the grant goes once the consumed event has completed
            t._grants_due.append(self)
            t.progress()
        else:
            self.send_grant()
        return Recv(self, req)

    def send_grant(self) -> None:
        if self.grant_req is not None:
            self.grant_req.Wait()  # 4 bytes, long sent
        self.n += 1
        self.grant[0] = self.n
        self.grant_req = self.transport.gcomm.Isend([self.grant, MPI.INT], self.peer, self.tag)


class Send(TransportRequest):
    __slots__ = ("slot", "nbytes", "tag", "ev", "mpi", "done")

    def __init__(self, slot, nbytes: int, tag: int):
        self.slot, self.nbytes, self.tag = slot, nbytes, tag
        self.ev, self.mpi, self.done = None, None, False

    def test(self) -> bool:
        if self.done:
            return True
        t = self.slot.transport
        if self.mpi is None:  # not issued yet, or (host-fenced) its header not yet sent
            t.progress()
            if self.mpi is None:
                return False
        if self.mpi.Test() and t.rt.done(self.ev):
            self.done = True
        return self.done

    def cancel(self) -> None:
        if self.mpi is not None and not self.mpi.Test():
            self.mpi.Cancel()
            self.mpi.Wait()


class SendSlot:
    def __init__(self, t: "CudaIpcTransport", buf: Buffer, peer: int):
        self.transport, self.buf, self.peer = t, buf, peer
        self.fence = t._event(ipc=False)

    def start(self, nbytes: int, tag: int) -> TransportRequest:
        t = self.transport
        t.rt.check(t.rt.eventRecord(self.fence, _cur(t.device)), "cudaEventRecord(fence)")
        req = Send(self, nbytes, tag)
        out = t._out.get((self.peer, tag))
        if out is None:
            raise CommError(f"[cuda_ipc rank {t.rank}] no receive ring of rank {self.peer} on "
                            f"tag {tag}: channel built on some ranks only?")
        out["queue"].append(req)
        t._queued += 1
        t._pump(out)
        return req
