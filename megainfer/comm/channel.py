"""One-way channel from M sender ranks to N receiver ranks (M2N dispatch, or N2M combine).

Every (sender, receiver) pair owns fixed buffers made at construction: a send ring of
``depth * streams`` slots per receiver, and per sender and stream a receive ring of ``depth``
slots whose receives are posted ahead (on tag-matching transports) and re-posted, in ring
order, when the caller releases a message. A message is one send of ``spec.nbytes(rows)``
bytes: a 32-byte header (rows, iteration, layer, micro-batch, kind, src) and the fields.

Tags: ``channel_id * MAX_STREAMS + micro_batch % streams``. Within one tag, MPI's
non-overtaking rule keeps messages in send order; the header's (iteration, layer,
micro_batch) is checked against what the receiver asked for.
"""
from __future__ import annotations

from typing import Optional

import torch

from megainfer.comm import spec as S
from megainfer.comm.errors import CommError, CommProtocolError, CommTimeoutError
from megainfer.comm.transport import Buffer, Request, Transport
from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.config import ConfigError

MAX_STREAMS = 256
MAX_CHANNELS = 127  # tags stay below 32767, the smallest TAG_UB MPI allows

FREE, POSTED, HELD = 0, 1, 2


class Header(tuple):
    """(kind, rows, iteration, layer, micro_batch, src, aux) of a received message
    (the wire header minus its magic word)."""

    __slots__ = ()
    kind = property(lambda s: s[0])
    rows = property(lambda s: s[1])
    iteration = property(lambda s: s[2])
    layer = property(lambda s: s[3])
    micro_batch = property(lambda s: s[4])
    src = property(lambda s: s[5])
    aux = property(lambda s: s[6])


class Message:
    """A received message: ``header`` and ``fields`` (views into the ring buffer, no copy,
    made on first use). Call ``release()`` once done with the views so the slot can take a
    new message."""

    __slots__ = ("header", "_layout", "_fields", "_release")

    def __init__(self, header: Header, layout: S.MessageLayout, release):
        self.header, self._layout, self._fields, self._release = header, layout, None, release

    @property
    def fields(self) -> dict:
        if self._fields is None:
            self._fields = self._layout.views(self.header[1])
        return self._fields

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    @property
    def kind(self) -> int:
        return self.header[0]

    @property
    def rows(self) -> int:
        return self.header[1]

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


class _Slot:
    __slots__ = ("buf", "layout", "req", "state", "what")

    def __init__(self, buf: Buffer, spec: S.MessageSpec):
        self.buf, self.layout = buf, S.MessageLayout(spec, buf.data)
        self.req: Optional[Request] = None
        self.state, self.what = FREE, None


class _RecvRing:
    __slots__ = ("slots", "post_ptr", "next_ptr", "peer", "tag")

    def __init__(self, slots: list, peer: int, tag: int):
        self.slots, self.post_ptr, self.next_ptr, self.peer, self.tag = slots, 0, 0, peer, tag


class Outgoing:
    """A reserved send slot: write ``fields[name]`` ([rows, *shape] views) in place, then
    ``Channel.post``."""

    __slots__ = ("peer", "rows", "_fields", "slot")

    def __init__(self, peer: int, rows: int, slot: _Slot):
        self.peer, self.rows, self._fields, self.slot = peer, rows, None, slot

    @property
    def fields(self) -> dict:
        if self._fields is None:
            self._fields = self.slot.layout.views(self.rows)
        return self._fields


class SendHandle:
    __slots__ = ("_ch", "_req", "_what")

    def __init__(self, ch: "Channel", req: Request, what: tuple):
        self._ch, self._req, self._what = ch, req, what

    def test(self) -> bool:
        return self._req.test()

    def wait(self) -> None:
        self._ch._wait(self._req, "send", self._what)


class RecvHandle:
    __slots__ = ("_ch", "_ring", "_slot", "_what", "_msg")

    def __init__(self, ch: "Channel", ring: _RecvRing, slot: _Slot, what: tuple):
        self._ch, self._ring, self._slot, self._what, self._msg = ch, ring, slot, what, None

    def test(self) -> bool:
        return self._msg is not None or self._slot.req.test()

    def wait(self) -> Message:
        """Block (per the wait policy) until the message is here; header + field views."""
        if self._msg is None:
            self._ch._wait(self._slot.req, "receive", self._what)
            self._msg = self._ch._open(self._ring, self._slot, self._what)
        return self._msg


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
        self.t, self.spec, self.streams, self.depth, self.policy = transport, spec, streams, depth, wait
        self.name, self.senders, self.receivers = name, list(senders), list(receivers)
        self.cid = transport.next_channel_id()
        if self.cid >= MAX_CHANNELS:
            raise ConfigError(f"channel {name}: more than {MAX_CHANNELS} channels on one transport")
        self.rank = transport.rank
        self._nbytes = [spec.nbytes(r) for r in range(spec.capacity + 1)]  # rows -> wire bytes
        nb = S.alloc_nbytes(spec)
        self._send = {p: [_Slot(transport.alloc(nb), spec) for _ in range(depth * streams)]
                      for p in self.receivers} if self.rank in self.senders else {}
        self._send_ptr = {p: 0 for p in self._send}
        self._recv = {}
        if self.rank in self.receivers:
            for p in self.senders:
                for s in range(streams):
                    ring = _RecvRing([_Slot(transport.alloc(nb), spec) for _ in range(depth)],
                                     p, self.cid * MAX_STREAMS + s)
                    self._recv[(p, s)] = ring
                    if not transport.ordered_posts:
                        self._post_ahead(ring)

    # ---- sending -------------------------------------------------------------------------
    def reserve(self, peer: int, rows: int) -> Outgoing:
        """The next send slot to ``peer`` with writable field views of ``rows`` rows."""
        ring = self._send.get(peer)
        if ring is None:
            raise CommError(f"[{self.name} rank {self.rank}] cannot send to {peer}: not a "
                            f"sender->receiver pair of this channel")
        if not 0 <= rows <= self.spec.capacity:
            self.spec.check_rows(rows, f"[{self.name}] message to rank {peer}")
        i = self._send_ptr[peer]
        slot = ring[i]
        self._send_ptr[peer] = (i + 1) % len(ring)
        if slot.req is not None:  # the slot's previous message must have left
            self._wait(slot.req, "send (ring full)", slot.what)
            slot.req = None
        return Outgoing(peer, rows, slot)

    def post(self, out: Outgoing, *, iteration: int, layer: int, micro_batch: int,
             kind: int = S.KIND_DATA, aux: int = 0) -> SendHandle:
        """Send a reserved slot: one transport send of header + fields."""
        slot = out.slot
        S.HEADER.pack_into(slot.buf.header, 0, S.MAGIC, kind, out.rows, iteration, layer,
                           micro_batch, self.rank, aux)
        slot.what = (out.peer, layer, micro_batch, iteration)
        tag = self.cid * MAX_STREAMS + micro_batch % self.streams
        slot.req = self.t.isend(slot.buf, self._nbytes[out.rows], out.peer, tag)
        return SendHandle(self, slot.req, slot.what)

    def send(self, peer: int, *, iteration: int, layer: int, micro_batch: int,
             kind: int = S.KIND_DATA, aux: int = 0, **fields: torch.Tensor) -> SendHandle:
        """Copy ``fields`` (each [rows, *shape], all spec fields) into a slot and send it."""
        rows = self._rows_of(fields, peer)
        out = self.reserve(peer, rows)
        for name, view in out.fields.items():
            if rows:
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
        ring = self._recv.get((peer, micro_batch % self.streams))
        if ring is None:
            raise CommError(f"[{self.name} rank {self.rank}] cannot receive from {peer}: not a "
                            f"sender->receiver pair of this channel")
        slot = ring.slots[ring.next_ptr]
        if slot.state == HELD:
            raise CommError(f"[{self.name} rank {self.rank}] receive ring from rank {peer} is "
                            f"full: release() earlier messages (depth={self.depth})")
        if slot.state == FREE:  # ordered transports post here, in the caller's order
            self._post(ring, slot)
            ring.post_ptr = (ring.post_ptr + 1) % self.depth
        ring.next_ptr = (ring.next_ptr + 1) % self.depth
        return RecvHandle(self, ring, slot, (peer, layer, micro_batch, iteration))

    def _post(self, ring: _RecvRing, slot: _Slot) -> None:
        slot.req = self.t.irecv(slot.buf, slot.buf.data.numel(), ring.peer, ring.tag)
        slot.state = POSTED

    def _post_ahead(self, ring: _RecvRing) -> None:
        while ring.slots[ring.post_ptr].state == FREE:
            self._post(ring, ring.slots[ring.post_ptr])
            ring.post_ptr = (ring.post_ptr + 1) % self.depth

    def _open(self, ring: _RecvRing, slot: _Slot, what: tuple) -> Message:
        h = S.HEADER.unpack_from(slot.buf.header)  # 8 x int32, host
        peer, layer, mb, it = what
        if h[S.H_MAGIC] != S.MAGIC or h[S.H_SRC] != peer or not 0 <= h[S.H_ROWS] <= self.spec.capacity:
            raise CommProtocolError(f"[{self.name} rank {self.rank}] corrupt header from rank "
                                    f"{peer} (layer={layer}, micro_batch={mb}): {h}")
        got = slot.req.received_nbytes()
        if got >= 0 and got != self._nbytes[h[S.H_ROWS]]:
            raise CommProtocolError(f"[{self.name} rank {self.rank}] message from rank {peer} has "
                                    f"{got} bytes, header says {h[S.H_ROWS]} rows "
                                    f"({self.spec.nbytes(h[S.H_ROWS])} bytes): spec mismatch?")
        if h[S.H_KIND] == S.KIND_DATA and (h[S.H_LAYER] != layer or h[S.H_MB] != mb or
                                           (it is not None and h[S.H_ITER] != it)):
            raise CommProtocolError(
                f"[{self.name} rank {self.rank}] from rank {peer}: expected (iteration={it}, "
                f"layer={layer}, micro_batch={mb}), got (iteration={h[S.H_ITER]}, "
                f"layer={h[S.H_LAYER]}, micro_batch={h[S.H_MB]}): streams out of step")
        slot.state = HELD
        return Message(Header(h[1:]), slot.layout, lambda: self._release(ring, slot))

    def _release(self, ring: _RecvRing, slot: _Slot) -> None:
        slot.state, slot.req = FREE, None
        if not self.t.ordered_posts:
            self._post_ahead(ring)

    # ---- waiting, closing ----------------------------------------------------------------
    def _wait(self, req: Request, what: str, ctx: tuple) -> None:
        if req.test():
            return
        waited = wait_until(req.test, self.policy)
        if waited < 0:
            peer, layer, mb, it = ctx if ctx else (-1, None, None, None)
            raise CommTimeoutError(f"[{self.name} rank {self.rank}] {what}", peer, layer, mb, it,
                                   -waited)

    def group(self):
        """Issue the sends/receives made inside as one group (NCCL); a no-op on MPI."""
        return self.t.group()

    def progress(self) -> None:
        self.t.progress()

    def close(self) -> None:
        """Cancel receives posted ahead and drop sends still pending; call before finalize."""
        for ring in self._recv.values():
            for slot in ring.slots:
                if slot.state == POSTED and not slot.req.test():
                    slot.req.cancel()
                slot.state, slot.req = FREE, None
        for ring in self._send.values():
            for slot in ring:
                if slot.req is not None and not slot.req.test():
                    slot.req.cancel()
                slot.req = None
