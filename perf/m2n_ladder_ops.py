"""The rungs of bench_m2n_ladder.py: the same M2N traffic with less and less of the channel.

Each maker returns ``op(i)`` for one dispatch (or combine) of ``size``-byte messages, built on
every rank of ``comm`` in the same order. From the bottom up:

* ``lean_op``: the channel's pattern in bare mpi4py: one persistent request per peer,
  receives posted ahead and re-started once read, each request waited in turn (``Test`` +
  ``sched_yield``). No header, no ring, no bookkeeping.
* ``inline_op``: the channel's own slots, rings, headers and persistent requests, its work
  written out in one function per message (reads channel internals: a bound, not a product path).
* the channel's API (``m2n_harness.P2P.op``): ``post(reserve())``, ``recv().wait().release()``.
"""
import os

import numpy as np
from mpi4py import MPI

from megainfer.comm import slot as SL

_yield = os.sched_yield


def lean_op(comm, senders, receivers, size, tag, reqs_out: list, pending_out: list):
    """The pattern alone, on ``size + 32`` bytes per message (the channel's header size)."""
    me, n = comm.Get_rank(), size + 32
    sends = [comm.Send_init([np.ones(n, np.uint8), n, MPI.BYTE], p, tag)
             for p in (receivers if me in senders else ())]
    recvs = [comm.Recv_init([np.empty(n, np.uint8), n, MPI.BYTE], p, tag)
             for p in (senders if me in receivers else ())]
    for q in recvs:
        q.Start()
    reqs_out += sends + recvs
    pending_out += recvs

    def run(i):
        for q in sends:
            q.Start()
        for q in sends:
            while not q.Test():
                _yield()
        for q in recvs:
            while not q.Test():
                _yield()
            q.Start()  # posted ahead for the next op
    return run


def _send_inline(ch, p, rows, i):
    ring, k = ch._send[p], ch._send_ptr[p]
    out = ring[k]
    ch._send_ptr[p] = k + 1 if k + 1 < len(ring) else 0
    if not out.clear:
        while not out.req.test():
            _yield()
    SL._pack(out.hdr, 0, ch._magic, 0, rows, i, 0, 0, ch.rank, 0)
    out.req = out.io.start(ch._nbytes[rows], ch._tags[0])
    out.clear = False
    return out


def _recv_inline(ch, p, i):
    ring = ch._recv[0][p]
    slot = ring.slots[ring.post_ptr]
    if slot.state == SL.FREE:  # re-post the slot released last time
        slot.req = slot.io.start(ring.nbytes, ring.tag)
        slot.state = SL.POSTED
        ring.post_ptr = ring.post_ptr + 1 if ring.post_ptr + 1 < ch.depth else 0
    slot = ring.slots[ring.next_ptr]
    ring.next_ptr = ring.next_ptr + 1 if ring.next_ptr + 1 < ch.depth else 0
    test = slot.req.test
    while not test():
        _yield()
    h = SL._unpack(slot.hdr)
    if h[0] != ch._magic or h[3] != i or h[6] != p:
        raise RuntimeError(f"[ladder rank {ch.rank}] bad header {h} from {p} (iteration {i})")
    slot.state = SL.FREE


def inline_op(p2p, rows):
    """``p2p``: an ``m2n_harness.P2P`` (one stream); its channel's slots, driven inline."""
    ch = p2p.ch

    def run(i):
        if p2p.me in p2p.s:
            outs = [_send_inline(ch, p, rows, i) for p in p2p.r]
            for out in outs:
                while not out.req.test():
                    _yield()
                out.clear = True
        if p2p.me in p2p.r:
            for p in p2p.s:
                _recv_inline(ch, p, i)
    return run
