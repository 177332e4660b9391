"""A ring slot and the handles on what it carries: ``Outgoing`` (a reserved send slot),
``SendHandle`` (a posted send), ``Message`` (a receive: first a handle, then the message).

Kept small on purpose: these objects are on every message's path, so the common case is a
few attribute reads, one header pack or unpack and one transport call.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import torch

from megainfer.comm import spec as S
from megainfer.comm.transport import Buffer, TransportRequest

if TYPE_CHECKING:
    from megainfer.comm.channel import Channel

_pack, _unpack = S.HEADER.pack_into, S.HEADER.unpack_from
KIND_DATA = S.KIND_DATA
MAX_VIEW_CACHE = 64  # row counts whose field views a slot keeps
FAST_POLLS = range(32)  # polls a receive makes before handing over to the wait policy
# Between those polls a receive calls sched_yield (cheap when nothing else wants the core)
# unless the policy spins: flat-out polls kept the sender sharing the core from posting
# (3-4 ranks on 2 cores, 2-32 KiB: up to 2.04x -> 1.57x Alltoallv; docs/comm.md).


def _no_yield() -> None:
    pass

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


class _Slot:
    """One ring slot: its buffer, typed views per row count (made once, kept), the slot's
    repeated transport operation ``io`` and its request in flight."""

    __slots__ = ("buf", "hdr", "layout", "io", "req", "clear", "state", "it", "layer", "mb",
                 "seq", "_views", "peer", "rows")

    def __init__(self, buf: Buffer, spec: S.MessageSpec, io, peer: int):
        self.buf, self.layout = buf, S.MessageLayout(spec, buf.data)
        self.hdr = memoryview(buf.header).cast("B")  # the host header's 32 bytes (struct is
        self.io, self.peer, self.rows = io, peer, 0  # faster on a memoryview than on numpy)
        self.req: Optional[TransportRequest] = None
        self.clear = True  # send slots: the previous message is known to have left
        self.state, self.seq, self._views = FREE, 0, {}
        self.it = self.layer = self.mb = None  # a send slot's last message, for errors

    @property
    def what(self) -> tuple:
        """(iteration, layer, micro_batch, peer) of the slot's last message."""
        return self.it, self.layer, self.mb, self.peer

    def views(self, rows: int) -> dict:
        v = self._views.get(rows)
        if v is None:
            v = self.layout.views(rows)
            if len(self._views) < MAX_VIEW_CACHE:
                self._views[rows] = v
        return v


class Outgoing(_Slot):
    """A reserved send slot: write ``fields[name]`` ([rows, *shape] views) in place, then
    ``Channel.post``. (The slot itself: valid until the ring comes round to it again.)"""

    __slots__ = ()

    @property
    def fields(self) -> dict:
        return self.views(self.rows)


class _RecvRing:
    __slots__ = ("slots", "post_ptr", "next_ptr", "tag", "nbytes")

    def __init__(self, slots: list, tag: int, nbytes: int):
        self.slots, self.post_ptr, self.next_ptr, self.tag, self.nbytes = slots, 0, 0, tag, nbytes


class SendHandle(tuple):
    """A posted send, ``(channel, slot, seq)``; ``wait()`` returns once its bytes left the
    slot. (A tuple: made by ``post`` without a Python frame. Slots hold no reference back to
    their channel, so a dropped channel is freed at once, not by the cycle collector.)"""

    __slots__ = ()

    def test(self) -> bool:
        _, s, seq = self  # a slot re-used since (seq moved on) had this message leave first
        if s.seq != seq or s.clear:
            return True
        if s.req.test():
            s.clear = True  # the next reserve() of this slot need not ask again
            return True
        return False

    def wait(self) -> None:
        ch, s, seq = self  # test(), written out: this is on every message's path
        if s.seq != seq or s.clear:
            return
        if not s.req.test():
            ch._wait(s.req, "send", s.what)
        s.clear = True


class Message:
    """One receive. ``recv()`` returns it as a handle: ``test()``, ``wait()``; ``wait()``
    returns it opened: ``header``, ``fields`` / ``msg[name]`` (views into the ring buffer,
    no copy). Call ``release()`` once done with the views so the slot can take a new message
    (it is re-posted at the next ``recv()`` on its stream, off the sender's critical path)."""

    __slots__ = ("_ch", "_slot", "_what", "_h")

    def __init__(self, ch: "Channel", slot: _Slot, what: tuple):
        self._ch, self._slot, self._what, self._h = ch, slot, what, None  # _h: 8 header ints

    def test(self) -> bool:
        return self._h is not None or self._slot.req.test()

    def wait(self) -> "Message":
        """Block (per the wait policy) until the message is here; returns it opened."""
        if self._h is None:
            req = self._slot.req
            ch = self._ch
            if not req.test():
                test, yield_ = req.test, os.sched_yield if ch._fast_yield else _no_yield
                for _ in FAST_POLLS:  # a short poll first: no clock, no call into wait.py
                    yield_()
                    if test():
                        break
                else:
                    ch._wait(req, "receive", self._what)
            slot = self._slot
            h = _unpack(slot.hdr)  # 8 x int32: magic, kind, rows, iteration, layer, mb, src, aux
            w = self._what  # field by field: a slice would allocate a tuple per message
            if h[0] != ch._magic or h[1] != KIND_DATA or h[3] != w[0] or h[4] != w[1] or \
                    h[5] != w[2] or h[6] != w[3] or not 0 <= h[2] <= ch._cap:
                ch._check(h, slot, w)
            slot.state = HELD
            self._h = h
        return self

    @property
    def header(self) -> Header:
        return Header(self.wait()._h[1:])

    @property
    def fields(self) -> dict:
        return self._slot.views(self.wait()._h[2])  # H_ROWS

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._slot.views(self.wait()._h[2])[name]

    @property
    def kind(self) -> int:
        return self.wait()._h[1]  # H_KIND

    @property
    def rows(self) -> int:
        return self.wait()._h[2]

    def release(self) -> None:
        if self._h is not None and self._ch is not None:
            self._ch = None
            self._slot.state = FREE


RecvHandle = Message  # what ``recv()`` returns, before and after ``wait()``
