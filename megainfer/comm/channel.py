"""One-way channel from M sender ranks to N receiver ranks (M2N dispatch, or N2M combine).

Every (sender, receiver) pair owns fixed buffers made at construction: a send ring of
``depth * streams`` slots per receiver, and per sender and stream a receive ring of ``depth``
slots, posted ahead and re-posted in ring order once released. A message is one send of
``spec.nbytes(rows)`` bytes: a 32-byte header (magic + spec fingerprint, kind, rows, iteration,
layer, micro-batch, src, aux) and the fields. Each slot binds its operation once (persistent
requests): nothing is allocated per message but the handle. Tags:
``channel_id * MAX_STREAMS + micro_batch % streams``; within a tag MPI's non-overtaking rule
keeps send order, and the header's (iteration, layer, micro_batch) is checked against what the
receiver asked for. docs/comm.md, "Rings, tags, ordering"."""
from __future__ import annotations

from typing import Optional

import torch

from megainfer.comm import spec as S
from megainfer.comm.errors import CommError, CommProtocolError, CommTimeoutError
from megainfer.comm.slot import (FREE, HELD, POSTED, Message, Outgoing, RecvHandle, SendHandle,
                                 _pack, _RecvRing, _Slot)
from megainfer.comm.transport import TransportRequest, Transport
from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.config import ConfigError

_handle = tuple.__new__  # SendHandle((channel, slot, seq)) without a Python frame
MAX_STREAMS = 256
MAX_CHANNELS = 127  # tags stay below 32767, the smallest TAG_UB MPI allows


class Channel:
    """M senders -> N receivers. Build it on every rank of the transport, in the same order."""

    def __init__(self, transport: Transport, senders: list[int], receivers: list[int],
                 spec: S.MessageSpec, *, streams: int = 1, depth: int = 2,
                 wait: WaitPolicy = WaitPolicy(), name: str = "m2n"):
        for role, ranks in (("senders", senders), ("receivers", receivers)):
            if not ranks or len(set(ranks)) != len(ranks) or \
                    not all(0 <= r < transport.size for r in ranks):
                raise ConfigError(f"channel.{role}={ranks!r}: need distinct ranks in "
                                  f"[0, {transport.size})")
        if not 1 <= streams <= MAX_STREAMS:
            raise ConfigError(f"channel.streams={streams!r}: must be in [1, {MAX_STREAMS}]")
        if depth < 1:
            raise ConfigError(f"channel.depth={depth!r}: must be >= 1")
        self.transport, self.spec, self.streams = transport, spec, streams
        self.depth, self.policy = depth, wait
        self.name, self.senders, self.receivers = name, list(senders), list(receivers)
        self.cid = transport.next_channel_id()
        if self.cid >= MAX_CHANNELS:
            raise ConfigError(f"channel {name}: more than {MAX_CHANNELS} channels on one transport")
        self.rank, self._ordered = transport.rank, transport.ordered_posts
        self._cap, self._magic = spec.capacity, spec.magic
        self._nbytes = [spec.nbytes(r) for r in range(spec.capacity + 1)]  # rows -> wire bytes
        self._tags = [self.cid * MAX_STREAMS + s for s in range(streams)]
        nb = S.alloc_nbytes(spec)

        def send_slot(p):
            buf = transport.alloc(nb)
            return Outgoing(buf, spec, transport.send_init(buf, p), p)
        self._send = {p: [send_slot(p) for _ in range(depth * streams)]
                      for p in self.receivers} if self.rank in self.senders else {}
        self._send_ptr = {p: 0 for p in self._send}
        self._recv = [{} for _ in range(streams)]  # [stream] -> {sender: ring}: no key tuple
        # made per message (under contention every Python step counts; docs/comm.md)
        if self.rank in self.receivers:
            for p in self.senders:
                for s in range(streams):
                    bufs = [transport.alloc(nb) for _ in range(depth)]
                    ring = _RecvRing([_Slot(b, spec, transport.recv_init(b, p), p) for b in bufs],
                                     self._tags[s], nb)
                    self._recv[s][p] = ring
                    if not self._ordered:
                        self._post_ahead(ring)
        transport.connect()  # collective: every rank builds every channel, in the same order

    @property
    def policy(self) -> WaitPolicy:
        return self._policy

    @policy.setter
    def policy(self, wait: WaitPolicy) -> None:
        """The wait policy; a receive's first polls yield the core unless it says spin."""
        self._policy = wait
        self._fast_yield = wait.mode != "spin" and wait.spin_s == 0

    # ---- sending -------------------------------------------------------------------------
    def reserve(self, peer: int, rows: int) -> Outgoing:
        """The next send slot to ``peer`` with writable field views of ``rows`` rows."""
        ring = self._send.get(peer)
        if ring is None:
            raise CommError(f"[{self.name} rank {self.rank}] cannot send to {peer}: not a "
                            f"sender->receiver pair of this channel")
        if not 0 <= rows <= self._cap:
            self.spec.check_rows(rows, f"[{self.name}] message to rank {peer}")
        i = self._send_ptr[peer]
        slot = ring[i]
        self._send_ptr[peer] = i + 1 if i + 1 < len(ring) else 0
        if not slot.clear:  # the slot's previous message must have left
            if not slot.req.test():
                self._wait(slot.req, "send (ring full)", slot.what)
            slot.clear = True
        slot.rows = rows
        return slot

    def post(self, out: Outgoing, *, iteration: int, layer: int, micro_batch: int,
             kind: int = S.KIND_DATA, aux: int = 0) -> SendHandle:
        """Send a reserved slot: one transport send of header + fields."""
        rows = out.rows
        _pack(out.hdr, 0, self._magic, kind, rows, iteration, layer, micro_batch, self.rank, aux)
        out.clear = False
        out.req = out.io.start(self._nbytes[rows], self._tags[micro_batch % self.streams])
        # off the critical path from here (the bytes are on their way): bookkeeping, and
        # whether the slot the next reserve() takes is free already (so it need not ask)
        out.it, out.layer, out.mb = iteration, layer, micro_batch  # for errors (no tuple)
        seq = out.seq = out.seq + 1
        nxt = self._send[out.peer][self._send_ptr[out.peer]]
        if not nxt.clear and nxt.req.test():
            nxt.clear = True
        return _handle(SendHandle, (self, out, seq))

    def send(self, peer: int, *, iteration: int, layer: int, micro_batch: int,
             kind: int = S.KIND_DATA, aux: int = 0, **fields: torch.Tensor) -> SendHandle:
        """Copy ``fields`` (each [rows, *shape], all spec fields) into a slot and send it."""
        rows = self._rows_of(fields, peer)
        out = self.reserve(peer, rows)
        if rows:
            for name, view in out.views(rows).items():
                view.copy_(fields[name])
        return self.post(out, iteration=iteration, layer=layer, micro_batch=micro_batch,
                         kind=kind, aux=aux)

    def send_control(self, peer: int, kind: int, *, iteration: int, layer: int,
                     micro_batch: int, aux: int = 0) -> SendHandle:
        """A header-only message (stop, rebalance) on the (layer, micro_batch) stream."""
        out = self.reserve(peer, 0)
        return self.post(out, iteration=iteration, layer=layer, micro_batch=micro_batch,
                         kind=kind, aux=aux)

    def _rows_of(self, fields: dict, peer: int) -> int:
        rows = None
        for f in self.spec.fields:
            t = fields.get(f.name)
            if t is None:
                raise ValueError(f"[{self.name}] message to rank {peer}: missing field {f.name!r}")
            if rows is None:
                rows = t.shape[0] if t.dim() else -1
            if tuple(t.shape) != (rows,) + f.shape or t.dtype != f.dtype:
                raise ValueError(f"[{self.name}] message to rank {peer}: field {f.name!r} is "
                                 f"{tuple(t.shape)} {t.dtype}, expected ({rows}, "
                                 f"{', '.join(map(str, f.shape))}) {f.dtype}")
        if len(fields) != len(self.spec.fields):
            extra = set(fields) - {f.name for f in self.spec.fields}
            raise ValueError(f"[{self.name}] message to rank {peer}: unknown fields {sorted(extra)}")
        return rows or 0

    # ---- receiving -----------------------------------------------------------------------
    def recv(self, peer: int, *, layer: int, micro_batch: int,
             iteration: Optional[int] = None) -> RecvHandle:
        """Handle on the next message from ``peer`` on this micro-batch's stream."""
        ring = self._recv[micro_batch % self.streams].get(peer)
        if ring is None:
            raise CommError(f"[{self.name} rank {self.rank}] cannot receive from {peer}: not a "
                            f"sender->receiver pair of this channel")
        slots = ring.slots
        if not self._ordered and slots[ring.post_ptr].state == FREE:
            self._post_ahead(ring)  # re-post slots released since, in ring order
        i = ring.next_ptr
        slot = slots[i]
        if slot.state != POSTED:
            if slot.state == HELD:
                raise CommError(f"[{self.name} rank {self.rank}] receive ring from rank {peer} "
                                f"is full: release() earlier messages (depth={self.depth})")
            self._post(ring, slot)  # ordered transports post here, in the caller's order
            ring.post_ptr = (ring.post_ptr + 1) % self.depth
        ring.next_ptr = i + 1 if i + 1 < self.depth else 0
        return Message(self, slot, (iteration, layer, micro_batch, peer))  # header order

    def _post(self, ring: _RecvRing, slot: _Slot) -> None:
        slot.req = slot.io.start(ring.nbytes, ring.tag)
        slot.state = POSTED

    def _post_ahead(self, ring: _RecvRing) -> None:
        slots, i = ring.slots, ring.post_ptr
        slot = slots[i]
        while slot.state == FREE:
            slot.req = slot.io.start(ring.nbytes, ring.tag)
            slot.state = POSTED
            i = i + 1 if i + 1 < self.depth else 0
            slot = slots[i]
        ring.post_ptr = i

    def _check(self, h: tuple, slot: _Slot, what: tuple) -> None:
        """Slow path of a header check: control messages, ``iteration=None``, or an error."""
        it, layer, mb, peer = what
        if h[0] != self._magic or h[6] != peer or not 0 <= h[2] <= self._cap:  # magic, src, rows
            self._bad_header(h, slot, what)
        if h[1] == S.KIND_DATA and (h[4] != layer or h[5] != mb or  # H_KIND, H_LAYER, H_MB
                                    (it is not None and h[3] != it)):
            raise CommProtocolError(
                f"[{self.name} rank {self.rank}] from rank {peer}: expected (iteration={it}, "
                f"layer={layer}, micro_batch={mb}), got (iteration={h[S.H_ITER]}, "
                f"layer={h[S.H_LAYER]}, micro_batch={h[S.H_MB]}): streams out of step")

    def _bad_header(self, h: tuple, slot: _Slot, what: tuple) -> None:
        _, layer, mb, peer = what
        where = f"[{self.name} rank {self.rank}] message from rank {peer} (layer={layer}, " \
                f"micro_batch={mb})"
        if h[0] >> 16 == S.MAGIC_HI >> 16 and h[0] != self._magic:
            raise CommProtocolError(f"{where}: sent under another MessageSpec (fingerprint "
                                    f"{h[0] & 0xFFFF:#06x}, ours {self._magic & 0xFFFF:#06x}: "
                                    f"{self.spec})")
        got = slot.req.received_nbytes()
        raise CommProtocolError(f"{where}: corrupt header {h} ({got} bytes received)")

    # ---- waiting, closing ----------------------------------------------------------------
    def _wait(self, req: TransportRequest, what: str, ctx: tuple) -> None:
        waited = wait_until(req.test, self.policy)
        if waited < 0:
            it, layer, mb, peer = ctx if ctx else (None, None, None, -1)
            raise CommTimeoutError(f"[{self.name} rank {self.rank}] {what}", peer, layer, mb, it,
                                   -waited)

    def group(self):
        """Issue the sends/receives made inside as one group (NCCL); a no-op on MPI."""
        return self.transport.group()

    def progress(self) -> None:
        self.transport.progress()

    def close(self) -> None:
        """Cancel receives posted ahead and drop sends still pending; call before finalize."""
        for ring in (r for rings in self._recv for r in rings.values()):
            for slot in ring.slots:
                if slot.state == POSTED and not slot.req.test():
                    slot.req.cancel()
                slot.state, slot.req = FREE, None
        for ring in self._send.values():
            for slot in ring:
                if slot.req is not None and not slot.req.test():
                    slot.req.cancel()
                slot.req = None
