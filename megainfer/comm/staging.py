"""MPI for device tensors: every slot is a device buffer with a (pinned, on cuda) host mirror.

A send copies the fields device -> host, waits for that copy (the one host wait per message:
slow, always correct; the baseline of the device transports), then starts the MPI send of the
mirror. A receive lands in the mirror; the first ``test()`` that sees it complete copies the
fields host -> device on the caller's current stream and records an event; the slot's next
receive is posted only once that copy finished. The header never leaves the host (the
mirror's first 32 bytes). On a CPU "device" the same code runs with CPU tensors and plain
copies (how the CPU tests exercise it). docs/comm.md, "Device tensors: which transport, and
what it costs"."""
from __future__ import annotations

import torch

from megainfer.comm.mpi import MpiTransport, _MpiRecvInit, _MpiSendInit
from megainfer.comm.spec import HEADER_BYTES
from megainfer.comm.transport import Buffer, TransportRequest, host_buffer


class _StagedSend:
    __slots__ = ("inner", "buf", "cuda")

    def __init__(self, inner: _MpiSendInit, buf: Buffer, cuda: bool):
        self.inner, self.buf, self.cuda = inner, buf, cuda

    def start(self, nbytes: int, tag: int) -> TransportRequest:
        _stage_out(self.buf, nbytes, self.cuda)
        return self.inner.start(nbytes, tag)


def _stage_out(buf: Buffer, nbytes: int, cuda: bool) -> None:
    """Fields device -> host mirror, complete on return (the header is already there)."""
    if nbytes > HEADER_BYTES:
        x = buf.extra
        x["host"][HEADER_BYTES:nbytes].copy_(buf.data[HEADER_BYTES:nbytes], non_blocking=cuda)
        if cuda:
            ev = x["event"]
            ev.record()
            ev.synchronize()  # the host mirror is complete before MPI reads it


class _StagedRecvRequest(TransportRequest):
    __slots__ = ("inner", "buf", "cuda", "done")

    def __init__(self, r: TransportRequest, buf: Buffer, cuda: bool):
        self.inner, self.buf, self.cuda, self.done = r, buf, cuda, False

    def test(self) -> bool:
        if self.done:
            return True
        if not self.inner.test():
            return False
        n = self.inner.received_nbytes()
        x = self.buf.extra
        if n > HEADER_BYTES:
            self.buf.data[HEADER_BYTES:n].copy_(x["host"][HEADER_BYTES:n], non_blocking=self.cuda)
            if self.cuda:
                x["event"].record()
                x["copying"] = True
        self.done = True
        return True

    def received_nbytes(self) -> int:
        return self.inner.received_nbytes()

    def cancel(self) -> None:
        self.inner.cancel()


class _StagedRecv:
    __slots__ = ("inner", "buf", "cuda")

    def __init__(self, inner: _MpiRecvInit, buf: Buffer, cuda: bool):
        self.inner, self.buf, self.cuda = inner, buf, cuda

    def start(self, nbytes: int, tag: int) -> TransportRequest:
        x = self.buf.extra
        if x.get("copying"):  # the last message's host -> device copy still reads the mirror
            x["event"].synchronize()
            x["copying"] = False
        return _StagedRecvRequest(self.inner.start(nbytes, tag), self.buf, self.cuda)


class StagingTransport(MpiTransport):
    """``MpiTransport`` whose slot buffers live on ``device`` (see the module docstring)."""

    def __init__(self, comm, device):
        super().__init__(comm)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def alloc(self, nbytes: int) -> Buffer:
        host = host_buffer(nbytes, pin=self.cuda)  # header = its first 32 bytes
        data = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        extra = {"np": host.data.numpy(), "host": host.data, "copying": False,
                 "event": torch.cuda.Event() if self.cuda else None}
        return Buffer(data, host.header, extra)

    def send_init(self, buf: Buffer, peer: int) -> _StagedSend:
        return _StagedSend(super().send_init(buf, peer), buf, self.cuda)

    def recv_init(self, buf: Buffer, peer: int) -> _StagedRecv:
        return _StagedRecv(super().recv_init(buf, peer), buf, self.cuda)

    def isend(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> TransportRequest:
        _stage_out(buf, nbytes, self.cuda)  # (again, for a slot past MAX_PERSISTENT: harmless)
        return super().isend(buf, nbytes, peer, tag)

    def irecv(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> TransportRequest:
        return _StagedRecvRequest(super().irecv(buf, nbytes, peer, tag), buf, self.cuda)
