"""NCCL transport: ctypes over ``libnccl.so.2``, grouped send/recv on a dedicated CUDA stream.

The library is found lazily (importing this module needs no GPU and no NCCL):
``$MEGAINFER_NCCL_LIB``, then the ``nvidia-nccl-cu12`` wheel (the ``nccl`` extra, also what a
CUDA build of torch depends on), then the loader's search path. The communicator is made
from a unique id that rank 0 draws and broadcasts over MPI (raw bytes, no pickle).

Semantics differ from MPI in two ways, both handled by ``Channel``:
* NCCL has no tags: a pair's receives match its sends in post order, so ``ordered_posts`` is
  True and the channel posts a receive only when ``recv()`` is called, in the caller's order.
  A posted receive occupies the channel's stream until its send arrives, so give each
  direction its own transport (``M2N`` does): a rank then only sends or only receives on it.
* Send and receive counts must match, so every message moves the slot's full
  ``nbytes(capacity)``; the header (rows, ...) says how much of it is real.

No host synchronisation per message: a send makes the comm stream wait on the caller's
current stream (device-side), issues the group, copies the received header to pinned host
memory and records one CUDA event per buffer; ``test()`` is ``event.query()``.
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Optional

import numpy as np
import torch

from megainfer.comm.errors import CommError
from megainfer.comm.transport import Buffer, Request, Transport

NCCL_UINT8 = 1  # ncclUint8 in ncclDataType_t
UNIQUE_ID_BYTES = 128


class NcclUnavailableError(CommError):
    """libnccl.so.2 could not be found or loaded, or no CUDA device is present."""


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def _candidates() -> list[str]:
    out = []
    if os.environ.get("MEGAINFER_NCCL_LIB"):
        out.append(os.environ["MEGAINFER_NCCL_LIB"])
    try:  # the nvidia-nccl-cu12 wheel installs nvidia/nccl/lib/libnccl.so.2
        import nvidia.nccl as _n  # type: ignore
        for d in list(getattr(_n, "__path__", [])):
            out += sorted(glob.glob(os.path.join(d, "lib", "libnccl.so*")))
    except ImportError:
        pass
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    out += sorted(glob.glob(os.path.join(torch_lib, "libnccl.so*")))
    out.append("libnccl.so.2")
    return out


_LIB: Optional[ctypes.CDLL] = None


def load_nccl(path: Optional[str] = None) -> ctypes.CDLL:
    """Load libnccl once and declare the prototypes used here."""
    global _LIB
    if _LIB is not None and path is None:
        return _LIB
    tried, lib = [], None
    for cand in ([path] if path else _candidates()):
        try:
            lib = ctypes.CDLL(cand)
            break
        except OSError as e:
            tried.append(f"{cand}: {e}")
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


class _NcclRequest(Request):
    """Done once its group was issued and the slot's event (recorded after it) has fired.
    Until the group is issued the event still reflects the slot's previous op, so a
    request queued in an open group is never done."""

    __slots__ = ("event", "done", "issued")

    def __init__(self, event: torch.cuda.Event):
        self.event, self.done, self.issued = event, False, False

    def test(self) -> bool:
        if not self.done and self.issued:
            self.done = self.event.query()
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
        self.stream = torch.cuda.Stream(device=self.device)
        self._group = 0
        self._ops: list = []  # (is_send, buf, peer) issued in the open group

    def alloc(self, nbytes: int) -> Buffer:
        data = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        header = torch.zeros(8, dtype=torch.int32).pin_memory()
        extra = {"pinned": header, "event": torch.cuda.Event(), "req": None}
        return Buffer(data, header.numpy(), extra)

    def isend(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> Request:
        return self._issue(True, buf, peer)

    def irecv(self, buf: Buffer, nbytes: int, peer: int, tag: int) -> Request:
        return self._issue(False, buf, peer)

    def _issue(self, is_send: bool, buf: Buffer, peer: int) -> Request:
        req = _NcclRequest(buf.extra["event"])
        buf.extra["req"] = req
        self._ops.append((is_send, buf, peer))
        if self._group == 0:
            self._flush()
        return req

    def group(self):
        return _Group(self)

    def _flush(self) -> None:
        ops, self._ops = self._ops, []
        if not ops:
            return
        producer = torch.cuda.current_stream(self.device)
        s = self.stream
        s.wait_stream(producer)  # device-side: fields written on the caller's stream land first
        with torch.cuda.stream(s):
            for is_send, buf, _ in ops:  # header: pinned host -> device, ordered before the send
                if is_send:
                    buf.data[:32].copy_(buf.extra["pinned"].view(torch.uint8), non_blocking=True)
            _check(self.lib, self.lib.ncclGroupStart(), "ncclGroupStart")
            for is_send, buf, peer in ops:
                fn = self.lib.ncclSend if is_send else self.lib.ncclRecv
                rc = fn(ctypes.c_void_p(buf.data.data_ptr()), buf.data.numel(), NCCL_UINT8, peer,
                        self._comm, ctypes.c_void_p(s.cuda_stream))
                if rc != 0:
                    self.lib.ncclGroupEnd()
                    _check(self.lib, rc, "ncclSend" if is_send else "ncclRecv")
            _check(self.lib, self.lib.ncclGroupEnd(), "ncclGroupEnd")
            for is_send, buf, _ in ops:  # received header -> pinned host, then the event
                if not is_send:
                    buf.extra["pinned"].view(torch.uint8).copy_(buf.data[:32], non_blocking=True)
                buf.extra["event"].record(s)
                buf.extra["req"].issued = True

    def close(self) -> None:
        if self._comm:
            self.lib.ncclCommDestroy(self._comm)
            self._comm = ctypes.c_void_p()


class _Group:
    def __init__(self, t: NcclTransport):
        self.t = t

    def __enter__(self):
        self.t._group += 1

    def __exit__(self, *exc):
        self.t._group -= 1
        if self.t._group == 0:
            self.t._flush()
