"""The interface every transport implements, and the buffer it moves.

A transport moves the bytes of one pre-allocated ``Buffer`` to a peer: ``isend``/``irecv``
return a request with ``test()``; ``send_init``/``recv_init`` bind a slot's buffer and peer
once so a message costs one ``start`` (persistent requests on MPI); ``Channel`` does the waiting, the headers and the rings.
Implementations: ``MpiTransport`` (mpi4py, CPU), ``StagingTransport`` (MPI through pinned host
mirrors of device buffers), ``CudaIpcTransport`` (one node, peers' slots written directly),
``NcclTransport`` (GPU, ctypes) and ``LoopbackTransport`` (in-process, for unit tests).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch


class Buffer:
    """One message slot: ``data`` [nbytes] uint8 on the transport's device, and ``header``,
    int32[8] on the host (the first 32 bytes of ``data`` on CPU; a pinned mirror on GPU)."""

    __slots__ = ("data", "header", "extra")

    def __init__(self, data: torch.Tensor, header: np.ndarray, extra=None):
        self.data, self.header, self.extra = data, header, extra


class TransportRequest:
    """An operation in flight. ``test()`` is True once it completed (and stays True)."""

    def test(self) -> bool:
        raise NotImplementedError

    def received_nbytes(self) -> int:
        """Bytes a completed receive got; -1 when the transport cannot tell."""
        return -1

    def cancel(self) -> None:
        """Give up a pending receive (at close). Best effort."""


class Reissue:
    """A slot's repeated operation (one buffer, one peer): ``start(nbytes, tag)`` issues it
    again and returns its request. This generic one calls ``isend``/``irecv`` each time;
    ``MpiTransport`` replaces it with persistent requests (``Send_init``/``Recv_init``)."""

    __slots__ = ("fn", "buf", "peer")

    def __init__(self, fn, buf: Buffer, peer: int):
        self.fn, self.buf, self.peer = fn, buf, peer

    def start(self, nbytes: int, tag: int) -> TransportRequest:
        return self.fn(self.buf, nbytes, self.peer, tag)


class Transport:
    """Byte mover between the ranks of one communicator."""

    rank: int
    size: int
    device: torch.device
    # True when receives match sends by per-pair post order and ignore tags (NCCL): the channel
    # then posts receives only when asked, in the caller's order, never ahead on its own.
    ordered_posts: bool = False

    def __init__(self):
        self._channels = 0

    def next_channel_id(self) -> int:
        """Channels built in the same order on every rank get the same id (their tag base)."""
        cid = self._channels
        self._channels += 1
        return cid

    def alloc(self, nbytes: int) -> Buffer:
        raise NotImplementedError

    def isend(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> TransportRequest:
        raise NotImplementedError

    def irecv(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> TransportRequest:
        raise NotImplementedError

    def send_init(self, buf: Buffer, peer: int) -> Reissue:
        """Sends of ``buf`` to ``peer``, issued per message with ``start(nbytes, tag)``; the
        caller starts one only after the previous one completed."""
        return Reissue(self.isend, buf, peer)

    def recv_init(self, buf: Buffer, peer: int) -> Reissue:
        """Receives into ``buf`` from ``peer``, re-armed with ``start(nbytes, tag)`` once the
        previous one completed and was consumed."""
        return Reissue(self.irecv, buf, peer)

    def connect(self) -> None:
        """Called by every rank at the end of each channel's construction (collective): a
        transport that must exchange something about the new slots does it here (CUDA IPC
        handles); a no-op for the others."""

    def group(self):
        """Context in which sends/receives are issued together (NCCL group); a no-op here."""
        return contextlib.nullcontext()

    def progress(self) -> None:
        """Let the library move bytes while the caller computes (MPI needs polls to progress)."""

    def close(self) -> None:
        pass


def host_buffer(nbytes: int, pin: bool = False, extra: Optional[object] = None) -> Buffer:
    """A CPU buffer whose header aliases its first 32 bytes."""
    # numpy's allocator advises huge pages for large arrays (torch's does not): MPI's
    # shared-memory copy of an 8 MB message is ~25% faster out of and into such a buffer
    data = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    if pin:
        data = data.pin_memory()
    header = data.numpy()[:32].view(np.int32)
    return Buffer(data, header, extra)
