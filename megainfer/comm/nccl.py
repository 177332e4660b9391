"""NCCL transport: ctypes over ``libnccl.so.2``, grouped send/recv on a dedicated CUDA stream.

The library is found lazily (``$MEGAINFER_NCCL_LIB``, the ``nvidia-nccl-cu12``/``-cu13``
wheels, the loader's path); rank 0's unique id is broadcast over MPI as raw bytes. Where NCCL
differs from MPI (``Channel`` handles each): no tags, receives match sends in post order
(``ordered_posts``) and a posted receive holds the stream, so each direction has its own
transport; one rank per GPU (``NCCL_MULTI_RANK_GPU_ENABLE=1`` on NCCL >= 2.30 aside); counts
must match, so every message moves the slot's full size. No host synchronisation per message:
the group waits on the caller's stream, headers move through pinned host memory, ``test()``
queries one CUDA event per buffer. docs/comm.md, "Transports"."""
from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np
import torch

from megainfer.comm.errors import CommError
from megainfer.comm.native_lib import library_candidates, load_first
from megainfer.comm.transport import Buffer, TransportRequest, Transport

NCCL_UINT8 = 1  # ncclUint8 in ncclDataType_t
UNIQUE_ID_BYTES = 128


class NcclUnavailableError(CommError):
    """libnccl.so.2 could not be found or loaded, or no CUDA device is present."""


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def _candidates() -> list[str]:
    """libnccl.so.2: $MEGAINFER_NCCL_LIB, the nvidia-nccl-cu12/-cu13 wheels, torch's lib/."""
    return library_candidates("nccl", "MEGAINFER_NCCL_LIB", ["libnccl.so.2"])


_LIB: Optional[ctypes.CDLL] = None


def load_nccl(path: Optional[str] = None) -> ctypes.CDLL:
    """Load libnccl once and declare the prototypes used here."""
    global _LIB
    if _LIB is not None and path is None:
        return _LIB
    lib, tried = load_first([path] if path else _candidates())
    if lib is None:
        raise NcclUnavailableError("libnccl.so.2 not found; install the `nccl` extra "
                                   "(nvidia-nccl-cu12) or set MEGAINFER_NCCL_LIB. Tried: "
                                   + "; ".join(tried))
    c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
    lib.ncclGetVersion.argtypes = [ctypes.POINTER(c_int)]
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(c_void_p), c_int, NcclUniqueId, c_int]
    lib.ncclCommDestroy.argtypes = [c_void_p]
    lib.ncclCommAbort.argtypes = [c_void_p]
    lib.ncclGetErrorString.argtypes = [c_int]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    for fn in (lib.ncclSend, lib.ncclRecv):
        fn.argtypes = [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
    for fn in (lib.ncclGetVersion, lib.ncclGetUniqueId, lib.ncclCommInitRank,
               lib.ncclCommDestroy, lib.ncclCommAbort, lib.ncclSend, lib.ncclRecv,
               lib.ncclGroupStart, lib.ncclGroupEnd):
        fn.restype = c_int
    if path is None:
        _LIB = lib
    return lib


def nccl_version(lib: Optional[ctypes.CDLL] = None) -> int:
    """NCCL's version code, e.g. 22703 for 2.27.3."""
    lib = lib or load_nccl()
    v = ctypes.c_int()
    _check(lib, lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    return v.value


def _check(lib, rc: int, what: str) -> None:
    if rc != 0:
        raise CommError(f"{what} failed: NCCL error {rc} ({lib.ncclGetErrorString(rc).decode()})")


CUDA_ERROR_NOT_READY = 600


class CudaDriver:
    """The CUDA driver calls a flush needs (``libcuda.so.1``), on torch's streams and events.
    Each returns after queueing its work; none waits for the device."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise NcclUnavailableError(f"libcuda.so.1 (the CUDA driver) not loadable: {e}")
        p, c_uint, c_size_t = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
        self.record, self.wait = lib.cuEventRecord, lib.cuStreamWaitEvent
        self.record.argtypes, self.wait.argtypes = [p, p], [p, p, c_uint]
        self.h2d, self.d2h = lib.cuMemcpyHtoDAsync_v2, lib.cuMemcpyDtoHAsync_v2
        self.h2d.argtypes = self.d2h.argtypes = [p, p, c_size_t, p]
        self.query = lib.cuEventQuery
        self.query.argtypes = [p]
        self._name = lib.cuGetErrorName
        self._name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for fn in (self.record, self.wait, self.h2d, self.d2h, self.query, self._name):
            fn.restype = ctypes.c_int

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._name(rc, ctypes.byref(name))
            raise CommError(f"{what} failed: CUDA error {rc} "
                            f"({(name.value or b'?').decode()})")


def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A torch event whose CUDA event exists (torch makes it at the first record)."""
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


class _NcclRequest(TransportRequest):
    """Done once its group was issued and the slot's event (recorded after it) has fired.
    Until the group is issued the event still reflects the slot's previous op, so a
    request queued in an open group is never done."""

    __slots__ = ("cu", "event", "done", "issued")

    def __init__(self, cu: CudaDriver, event: int):
        self.cu, self.event, self.done, self.issued = cu, event, False, False

    def test(self) -> bool:
        if not self.done and self.issued:
            rc = self.cu.query(self.event)
            if rc != CUDA_ERROR_NOT_READY:
                self.cu.check(rc, "cuEventQuery")
                self.done = True
        return self.done


class NcclTransport(Transport):
    """One NCCL communicator over the ranks of an MPI communicator, one CUDA stream."""

    ordered_posts = True

    def __init__(self, comm, device: Optional[torch.device] = None, lib_path: Optional[str] = None):
        super().__init__()
        if not torch.cuda.is_available():
            raise NcclUnavailableError("NcclTransport needs a CUDA device; none is visible")
        from mpi4py import MPI
        self.lib = load_nccl(lib_path)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        uid = NcclUniqueId()
        if self.rank == 0:
            _check(self.lib, self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        raw = np.frombuffer(uid, dtype=np.uint8)  # aliases uid's 128 bytes
        comm.Bcast([raw, MPI.BYTE], root=0)
        self._comm = ctypes.c_void_p()
        _check(self.lib, self.lib.ncclCommInitRank(ctypes.byref(self._comm), self.size, uid,
                                                   self.rank), "ncclCommInitRank")
        self.cu = CudaDriver()
        self.stream = torch.cuda.Stream(device=self.device)
        self._s = ctypes.c_void_p(self.stream.cuda_stream)
        self._fence = _event(self.stream)  # the caller's stream -> the comm stream
        self._group = 0
        self._ops: list = []  # (is_send, buf, peer) issued in the open group

    def alloc(self, nbytes: int) -> Buffer:
        data = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        header = torch.zeros(8, dtype=torch.int32).pin_memory()  # [8] int32 pinned mirror
        ev = _event(self.stream)
        extra = {"pinned": header, "event": ev, "ev": ctypes.c_void_p(ev.cuda_event),
                 "dptr": ctypes.c_void_p(data.data_ptr()),
                 "hptr": ctypes.c_void_p(header.data_ptr()), "req": None}
        return Buffer(data, header.numpy(), extra)

    def isend(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> TransportRequest:
        return self._issue(True, buf, peer)

    def irecv(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> TransportRequest:
        return self._issue(False, buf, peer)

    def _issue(self, is_send: bool, buf: Buffer, peer: int) -> TransportRequest:
        req = self._request_for(buf)
        buf.extra["req"] = req
        self._ops.append((is_send, buf, peer))
        if self._group == 0:
            self._flush()
        return req

    def _request_for(self, buf: Buffer) -> _NcclRequest:
        return _NcclRequest(self.cu, buf.extra["ev"])

    def group(self):
        return _Group(self)

    def _flush(self) -> None:
        ops, self._ops = self._ops, []
        if not ops:
            return
        cu, s = self.cu, self._s
        producer = torch.cuda.current_stream(self.device).cuda_stream
        # device-side: the fields the caller wrote on its stream land before the sends read them
        fence = self._fence.cuda_event
        cu.check(cu.record(fence, producer), "cuEventRecord")
        cu.check(cu.wait(s, fence, 0), "cuStreamWaitEvent")
        for is_send, buf, _ in ops:  # header: pinned host -> device, ordered before the send
            if is_send:
                x = buf.extra
                cu.check(cu.h2d(x["dptr"], x["hptr"], 32, s), "cuMemcpyHtoDAsync")
        self._nccl_group(ops)
        for is_send, buf, _ in ops:  # received header -> pinned host, then the event
            x = buf.extra
            if not is_send:
                cu.check(cu.d2h(x["hptr"], x["dptr"], 32, s), "cuMemcpyDtoHAsync")
            cu.check(cu.record(x["ev"], s), "cuEventRecord")
            x["req"].issued = True

    def _nccl_group(self, ops: list) -> None:
        """ncclGroupStart, each op's whole buffer sent or received on the comm stream, End."""
        lib, comm, s = self.lib, self._comm, self._s
        _check(lib, lib.ncclGroupStart(), "ncclGroupStart")
        for is_send, buf, peer in ops:
            fn = lib.ncclSend if is_send else lib.ncclRecv
            rc = fn(buf.extra["dptr"], buf.data.numel(), NCCL_UINT8, peer, comm, s)
            if rc != 0:
                lib.ncclGroupEnd()
                _check(lib, rc, "ncclSend" if is_send else "ncclRecv")
        _check(lib, lib.ncclGroupEnd(), "ncclGroupEnd")

    def close(self) -> None:
        if self._comm:
            self.lib.ncclCommDestroy(self._comm)
            self._comm = ctypes.c_void_p()


class _Group:
    def __init__(self, t: NcclTransport):
        self.transport = t

    def __enter__(self):
        self.transport._group += 1

    def __exit__(self, *exc):
        self.transport._group -= 1
        if self.transport._group == 0:
            self.transport._flush()
