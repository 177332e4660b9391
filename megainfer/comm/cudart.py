"""The CUDA runtime calls the device transports need, through ctypes on ``libcudart``.

Raw ``cudaMalloc`` (not torch's caching allocator: an IPC handle covers a whole allocation,
and the caching allocator pools many tensors in one), IPC handles for memory and events,
interprocess events, async copies and stream waits on torch's own streams. Nothing here is
imported at module load: importing this file needs neither a GPU nor the library.

The library: the ``libcudart`` torch already loaded (read from ``/proc/self/maps`` once torch
initialised CUDA: the same runtime instance, hence the same primary context), then
``$MEGAINFER_CUDART_LIB``, the ``nvidia-cuda-runtime`` wheels beside torch's nvidia libs
(``nvidia/cuda_runtime/lib``, ``nvidia/cu13/lib``), torch's own ``lib/``, then the loader path.
"""
from __future__ import annotations

import ctypes
from typing import Optional

from megainfer.comm.errors import CommError
from megainfer.comm.native_lib import library_candidates, load_first

IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t: 64 opaque bytes each
EVENT_DISABLE_TIMING, EVENT_INTERPROCESS = 0x2, 0x4
IPC_LAZY_ENABLE_PEER_ACCESS = 0x1
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
ERROR_NOT_READY = 600  # cudaErrorNotReady


class CudaUnavailableError(CommError):
    """libcudart could not be found or loaded, or no CUDA device is visible."""


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]

    def raw(self) -> bytes:
        """All 64 bytes. (``bytes(h.reserved)`` would not do: ctypes reads a ``c_char`` array
        field as a C string, cut at its first zero byte.)"""
        return ctypes.string_at(ctypes.addressof(self), IPC_HANDLE_BYTES)


def candidates() -> list[str]:
    """Where libcudart may be, best first (see the module docstring)."""
    return library_candidates("cudart", "MEGAINFER_CUDART_LIB",
                              ["libcudart.so", "libcudart.so.13", "libcudart.so.12"],
                              already_loaded=True)


class CudaRuntime:
    """ctypes prototypes over one loaded libcudart. Every call returns after queueing its
    work unless its name says it waits (``synchronize``); ``check`` turns an error code into
    a ``CommError`` naming the call."""

    def __init__(self, path: Optional[str] = None):
        lib, tried = load_first([path] if path else candidates())
        if lib is None:
            raise CudaUnavailableError("libcudart not found (set MEGAINFER_CUDART_LIB). Tried: "
                                       + "; ".join(tried))
        self.lib, self.path = lib, getattr(lib, "_name", path)
        p, P, i, u, sz = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                          ctypes.c_uint, ctypes.c_size_t)
        protos = {
            "cudaMalloc": [P, sz], "cudaFree": [p], "cudaMemset": [p, i, sz],
            "cudaIpcGetMemHandle": [ctypes.POINTER(IpcHandle), p],
            "cudaIpcOpenMemHandle": [P, IpcHandle, u], "cudaIpcCloseMemHandle": [p],
            "cudaEventCreateWithFlags": [P, u], "cudaEventDestroy": [p],
            "cudaIpcGetEventHandle": [ctypes.POINTER(IpcHandle), p],
            "cudaIpcOpenEventHandle": [P, IpcHandle],
            "cudaEventRecord": [p, p], "cudaEventQuery": [p], "cudaEventSynchronize": [p],
            "cudaStreamWaitEvent": [p, p, u], "cudaMemcpyAsync": [p, p, sz, i, p],
            "cudaGetDevice": [ctypes.POINTER(i)], "cudaSetDevice": [i],
            "cudaDeviceGetPCIBusId": [ctypes.c_char_p, i, i],
        }
        for name, args in protos.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, i
            setattr(self, name[4].lower() + name[5:], fn)  # cudaMalloc -> self.malloc
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [i], ctypes.c_char_p
        lib.cudaGetErrorName.argtypes, lib.cudaGetErrorName.restype = [i], ctypes.c_char_p

    def error(self, rc: int) -> str:
        return (f"{self.lib.cudaGetErrorName(rc).decode()}: "
                f"{self.lib.cudaGetErrorString(rc).decode()}")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise CommError(f"{what} failed: CUDA error {rc} ({self.error(rc)})")

    # ---- the few composite calls the transports make -----------------------------------
    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self.check(self.malloc(ctypes.byref(ptr), max(nbytes, 1)), f"cudaMalloc({nbytes})")
        self.check(self.memset(ptr, 0, max(nbytes, 1)), "cudaMemset")
        return ptr.value

    def _handle(self, get, ptr: int, what: str) -> bytes:
        h = IpcHandle()
        self.check(get(ctypes.byref(h), ctypes.c_void_p(ptr)), what)
        return h.raw()

    def mem_handle(self, ptr: int) -> bytes:
        return self._handle(self.ipcGetMemHandle, ptr, "cudaIpcGetMemHandle")

    def open_mem(self, handle: bytes) -> int:
        """The peer's allocation in this process; raises with the CUDA reason."""
        ptr = ctypes.c_void_p()
        h = IpcHandle.from_buffer_copy(handle)
        self.check(self.ipcOpenMemHandle(ctypes.byref(ptr), h, IPC_LAZY_ENABLE_PEER_ACCESS),
                   "cudaIpcOpenMemHandle")
        return ptr.value

    def ipc_event(self) -> int:
        """An interprocess event (no timing: required for IPC)."""
        ev = ctypes.c_void_p()
        self.check(self.eventCreateWithFlags(ctypes.byref(ev), EVENT_INTERPROCESS |
                                             EVENT_DISABLE_TIMING), "cudaEventCreateWithFlags")
        return ev.value

    def event_handle(self, ev: int) -> bytes:
        return self._handle(self.ipcGetEventHandle, ev, "cudaIpcGetEventHandle")

    def open_event(self, handle: bytes) -> int:
        ev = ctypes.c_void_p()
        self.check(self.ipcOpenEventHandle(ctypes.byref(ev), IpcHandle.from_buffer_copy(handle)),
                   "cudaIpcOpenEventHandle")
        return ev.value

    def done(self, ev: int) -> bool:
        """cudaEventQuery: True once the event's last record completed (never waits)."""
        rc = self.eventQuery(ctypes.c_void_p(ev))
        if rc == ERROR_NOT_READY:
            return False
        self.check(rc, "cudaEventQuery")
        return True

    def pci_bus_id(self, device: int) -> str:
        buf = ctypes.create_string_buffer(32)
        self.check(self.deviceGetPCIBusId(buf, 32, device), "cudaDeviceGetPCIBusId")
        return buf.value.decode()


_RT: Optional[CudaRuntime] = None


def runtime() -> CudaRuntime:
    """The process's CudaRuntime, loaded once (after torch initialised CUDA)."""
    global _RT
    if _RT is None:
        import torch
        if not torch.cuda.is_available():
            raise CudaUnavailableError("no CUDA device is visible to this process")
        torch.cuda.init()
        _RT = CudaRuntime()
    return _RT


class _RawArray:
    """A raw device pointer as ``__cuda_array_interface__`` (uint8, 1-D), for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def device_tensor(ptr: int, nbytes: int, device):
    """A torch uint8 tensor [nbytes] over memory torch does not own (kept alive by the caller)."""
    import torch
    with torch.cuda.device(device):
        return torch.as_tensor(_RawArray(ptr, nbytes), device=device)
