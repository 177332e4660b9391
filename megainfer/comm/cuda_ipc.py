"""CUDA IPC transport: ranks of one node (several may share a GPU) write straight into their
peer's receive slots.

* Memory: every slot is a raw ``cudaMalloc``; the receiver owns its rings and hands each sender
  their IPC handles at ``connect`` (collective, at a channel's construction).
* Data: a send fences on the caller's stream and the target slot's *consumed* event, copies the
  fields into the peer slot, records its *ready* event; the 32-byte header follows over MPI.
  Re-arming a slot records *consumed* and sends a 4-byte *grant* (the k-th frees slot
  ``k % depth``). Invariant: an interprocess event is recorded only by its creator.
* ``sync="host"`` (``auto`` when ranks share a GPU): no stream waits on a peer's event.
docs/comm.md, "Device tensors: which transport, and what it costs"."""
from __future__ import annotations

import ctypes
from collections import deque

import numpy as np
import torch
from mpi4py import MPI

from megainfer.comm.cudart import runtime, device_tensor, MEMCPY_DEFAULT
from megainfer.comm.errors import CommError, TransportChoiceError
from megainfer.comm.ipc_slots import RecvSlot, Send, SendSlot
from megainfer.comm.spec import HEADER_BYTES
from megainfer.comm.transport import Buffer, Transport


class IpcSetupError(CommError):
    """The transport cannot work between some ranks (other nodes, a handle that won't open)."""


def agree(comm, errors: list[str], what: str) -> None:
    """Collective: raise on every rank if any rank found a problem, naming them all."""
    every = comm.allgather(errors)
    lines = [e for errs in every for e in errs]
    if lines:
        raise IpcSetupError(f"{what}: " + "; ".join(lines))


def check_cuda_ipc(hosts: list[str]) -> None:
    """Raise on every rank alike unless all ranks (their host names) are on one node."""
    if len(set(hosts)) > 1:
        by: dict = {}
        for r, h in enumerate(hosts):
            by.setdefault(h, []).append(r)
        raise TransportChoiceError(
            "comm.transport=cuda_ipc needs every rank on one node; ranks are on "
            + ", ".join(f"{h} (ranks {v})" for h, v in by.items()) + ": use nccl or auto")


class CudaIpcTransport(Transport):
    """Point to point between the ranks of one node, over CUDA IPC (see the module docstring)."""

    def __init__(self, comm, device: torch.device, sync: str = "auto"):
        """``sync``: device (streams wait on the peer's events), host (the hosts wait for
        completions: see the module docstring), auto (host when ranks share a GPU)."""
        super().__init__()
        self.rt = runtime()
        self.device = torch.device(device)
        torch.cuda.set_device(self.device)
        self.comm, self.gcomm = comm.Dup(), comm.Dup()  # headers; grants
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        check_cuda_ipc(self.comm.allgather(MPI.Get_processor_name()))  # all raise alike
        self.stream = torch.cuda.Stream(device=self.device)
        self._s = ctypes.c_void_p(self.stream.cuda_stream)
        self._new_rings: dict = {}  # (sender, tag) -> [RecvSlot] in ring order, since connect
        self._rings: dict = {}  # all of them (self-sends look theirs up here)
        self._out: dict = {}  # (receiver, tag) -> remote ring state
        self._queued = 0  # sends waiting for a grant
        if sync not in ("auto", "device", "host"):
            raise CommError(f"cuda_ipc sync={sync!r}: must be auto, device or host")
        if sync == "auto":
            gpus = self.comm.allgather((MPI.Get_processor_name(), self._bus_id()))
            sync = "host" if len(set(gpus)) < len(gpus) else "device"
        self.host_sync = sync == "host"
        self._headers_due, self._grants_due = deque(), deque()  # host-fenced, in issue order
        self._allocs, self._opened, self._events = [], [], []

    def _bus_id(self) -> str:
        if self.device.type != "cuda":
            return ""
        i = self.device.index
        return self.rt.pci_bus_id(torch.cuda.current_device() if i is None else i)

    def _event(self, ipc: bool) -> ctypes.c_void_p:
        if ipc:
            ev = self.rt.ipc_event()
        else:
            e = ctypes.c_void_p()
            self.rt.check(self.rt.eventCreateWithFlags(ctypes.byref(e), 0x2), "cudaEventCreate")
            ev = e.value
        self._events.append(ev)
        return ctypes.c_void_p(ev)

    def alloc(self, nbytes: int) -> Buffer:
        ptr = self.rt.alloc(nbytes)
        self._allocs.append(ptr)
        data = device_tensor(ptr, nbytes, self.device)
        return Buffer(data, np.zeros(8, dtype=np.int32), {"ptr": ptr})

    def send_init(self, buf: Buffer, peer: int) -> SendSlot:
        return SendSlot(self, buf, peer)

    def recv_init(self, buf: Buffer, peer: int) -> RecvSlot:
        return RecvSlot(self, buf, peer)

    def isend(self, buf, nbytes, peer, tag):
        return self.send_init(buf, peer).start(nbytes, tag)

    def irecv(self, buf, nbytes, peer, tag):
        raise CommError("cuda_ipc receives go through recv_init (slots are bound to rings)")

    # ---- connecting a channel's rings (collective) ---------------------------------------
    def connect(self) -> None:
        rt, new, errors = self.rt, self._new_rings, []
        self._rings.update(new)
        self._new_rings = {}
        to = [[] for _ in range(self.size)]  # per sender: (tag, [(mem, consumed) handles])
        for (src, tag), slots in new.items():
            if src == self.rank:
                to[src].append((tag, None))
            else:
                to[src].append((tag, [(rt.mem_handle(s.buf.extra["ptr"]),
                                       rt.event_handle(s.consumed.value)) for s in slots]))
        back = [[] for _ in range(self.size)]  # per receiver: (tag, [ready handles])
        for dst, rings in enumerate(self.comm.alltoall(to)):
            for tag, handles in rings:
                try:
                    back[dst].append((tag, self._open_ring(dst, tag, handles)))
                except CommError as e:
                    errors.append(f"rank {self.rank} cannot open rank {dst}'s ring (tag {tag}): {e}")
        agree(self.comm, errors, "cuda_ipc: IPC handles would not open (same node, same driver, "
                                 "no container isolation between the ranks?)")
        for src, rings in enumerate(self.comm.alltoall(back)):
            for tag, readies in rings:
                for slot, ready in zip(self._rings[(src, tag)], readies):
                    if src != self.rank:
                        ready = rt.open_event(ready)
                        self._events.append(ready)  # imported events are destroyed too
                    slot.ready = ctypes.c_void_p(ready)

    def _open_ring(self, dst: int, tag: int, handles) -> list:
        rt = self.rt
        if handles is None:  # myself: my own slots and events
            mine = self._rings[(self.rank, tag)]
            ptrs, consumed = [s.buf.extra["ptr"] for s in mine], [s.consumed for s in mine]
        else:
            ptrs, consumed = [], []
            for mem, ev in handles:
                p = rt.open_mem(mem)
                self._opened.append(p)
                ptrs.append(p)
                consumed.append(ctypes.c_void_p(rt.open_event(ev)))
                self._events.append(consumed[-1].value)
        ready = [self._event(ipc=dst != self.rank) for _ in ptrs]
        gbuf = np.zeros(1, dtype=np.int32)
        self._out[(dst, tag)] = {"ptrs": ptrs, "consumed": consumed, "ready": ready,
                                 "queue": deque(), "sent": 0, "granted": 0, "peer": dst,
                                 "tag": tag, "gbuf": gbuf,
                                 "greq": self.gcomm.Irecv([gbuf, MPI.INT], dst, tag)}
        return [e.value if dst == self.rank else self.rt.event_handle(e.value) for e in ready]

    # ---- moving bytes --------------------------------------------------------------------
    def _pump(self, out: dict) -> None:
        """Issue queued sends of one remote ring whose grants are in (never waits)."""
        q = out["queue"]
        while q:
            while out["granted"] <= out["sent"] and out["greq"].Test():
                out["granted"] += 1
                out["greq"] = self.gcomm.Irecv([out["gbuf"], MPI.INT], out["peer"], out["tag"])
            if out["granted"] <= out["sent"]:
                return
            self._issue(out, q.popleft())
            self._queued -= 1

    def _issue(self, out: dict, req: Send) -> None:
        rt, s, slot = self.rt, self._s, req.slot
        j = out["sent"] % len(out["ptrs"])
        out["sent"] += 1
        rt.check(rt.streamWaitEvent(s, slot.fence, 0), "cudaStreamWaitEvent(fence)")
        if not self.host_sync:  # host-fenced: the grant came after the slot was consumed
            rt.check(rt.streamWaitEvent(s, out["consumed"][j], 0), "cudaStreamWaitEvent(consumed)")
        n = req.nbytes - HEADER_BYTES
        if n > 0:
            src = slot.buf.extra["ptr"] + HEADER_BYTES
            rt.check(rt.memcpyAsync(ctypes.c_void_p(out["ptrs"][j] + HEADER_BYTES),
                                    ctypes.c_void_p(src), n, MEMCPY_DEFAULT, s), "cudaMemcpyAsync")
        ev = out["ready"][j]
        rt.check(rt.eventRecord(ev, s), "cudaEventRecord(ready)")
        req.ev = ev.value
        if self.host_sync:
            self._headers_due.append((req, out["peer"]))
        else:
            req.mpi = self.comm.Isend([slot.buf.header, MPI.INT], out["peer"], req.tag)

    def progress(self) -> None:
        if self._queued:
            for out in self._out.values():
                if out["queue"]:
                    self._pump(out)
        if self.due:
            self._pump_due()

    @property
    def due(self) -> bool:
        """Host-fenced headers or grants still waiting for their events."""
        return bool(self._headers_due or self._grants_due)

    def _pump_due(self) -> None:
        """Host-fenced: headers of copies that completed, grants of slots consumed (in order:
        events of one stream complete in the order they were recorded)."""
        rt, hq, gq = self.rt, self._headers_due, self._grants_due
        while hq and rt.done(hq[0][0].ev):
            req, peer = hq.popleft()
            req.mpi = self.comm.Isend([req.slot.buf.header, MPI.INT], peer, req.tag)
        while gq and rt.done(gq[0].consumed.value):
            gq.popleft().send_grant()

    def close(self) -> None:
        """Collective. Cancels grant receives, unmaps peers' memory, frees ours."""
        if self.due:  # host-fenced leftovers: every event completes after a synchronize
            torch.cuda.synchronize(self.device)
            self._pump_due()
        for out in self._out.values():
            if not out["greq"].Test():
                out["greq"].Cancel()
                out["greq"].Wait()
        for slots in self._rings.values():
            for s in slots:
                if s.grant_req is not None:
                    s.grant_req.Wait()
        torch.cuda.synchronize(self.device)
        self.comm.Barrier()
        for p in self._opened:
            self.rt.ipcCloseMemHandle(ctypes.c_void_p(p))
        self.comm.Barrier()  # nobody maps our memory any more
        for p in self._allocs:
            self.rt.free(ctypes.c_void_p(p))
        for ev in self._events:
            self.rt.eventDestroy(ctypes.c_void_p(ev))
        self._opened, self._allocs, self._events = [], [], []
        self.comm.Free()
        self.gcomm.Free()
