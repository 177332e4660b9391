"""The benchmark's M2N traffic through bare mpi4py, no megainfer code: a stand-in for
``bench_m2n_mpi.P2P`` (``--bare``) that reproduces MPI-level faults without the channel.

Same pattern as the channel: per peer two slot buffers, a persistent send per (slot, bytes),
receives pre-posted and re-posted once read, a header (iteration, source) checked on arrival,
payload bytes counted. A wait polls ``Test`` with ``sched_yield`` (or flat out for the spin
policy) and raises after ``TIMEOUT_S``; a wrong header raises at once.
"""
import os
import time

import numpy as np
from mpi4py import MPI

HEADER = 32
TIMEOUT_S = 60.0


class BareP2P:
    """Senders -> receivers over ``t.comm`` (the transport's private duplicate) on ``tag``
    (dispatch and combine share the communicator: give them different tags)."""

    def __init__(self, t, senders, receivers, cap_rows, row_bytes, tag):
        self.c, self.s, self.r, self.row, self.tag = t.comm, senders, receivers, row_bytes, tag
        self.me = self.c.Get_rank()
        cap = cap_rows * row_bytes + HEADER
        mine = receivers if self.me in senders else []
        self.sbuf = {p: [np.zeros(cap, np.uint8) for _ in range(2)] for p in mine}
        self.sreq = {p: [{}, {}] for p in mine}
        self.sptr = dict.fromkeys(mine, 0)
        theirs = senders if self.me in receivers else []
        self.rbuf = {p: [np.zeros(cap, np.uint8) for _ in range(2)] for p in theirs}
        self.rreq = {p: [self.c.Recv_init([b, cap, MPI.BYTE], p, self.tag) for b in self.rbuf[p]]
                     for p in theirs}
        self.rptr = dict.fromkeys(theirs, 0)
        self._all = [q for qs in self.rreq.values() for q in qs]
        MPI.Prequest.Startall(self._all)
        self.ch = self  # bench_config closes ``p2p.ch``

    def close(self):
        for q in self._all:  # pre-posted receives nobody will send to
            if not q.Test():
                q.Cancel()
                q.Wait()
        for q in self._all + [q for per in self.sreq.values() for d in per for q in d.values()]:
            q.Free()

    def _wait(self, q, spin, what, st=None):
        t0 = time.monotonic()
        while not q.Test(st):
            if not spin:
                os.sched_yield()
            if time.monotonic() - t0 > TIMEOUT_S:
                raise RuntimeError(f"[bare rank {self.me}] {what}: no completion in {TIMEOUT_S} s")

    def op(self, rows, policy, flat_first_polls=False):
        """Like ``P2P.op``; only spin or not matters here (``flat_first_polls`` is ignored)."""
        spin, nb = policy.mode == "spin", rows * self.row + HEADER

        def run(i):
            if self.me in self.s:
                hs = [self._send(p, i, nb) for p in self.r]
                for p, q in zip(self.r, hs):
                    self._wait(q, spin, f"send to {p}, iteration {i}")
            if self.me in self.r:
                for p in self.s:
                    self._recv(p, i, nb, spin)
        return run

    def _send(self, p, i, nb):
        k = self.sptr[p]
        self.sptr[p] = 1 - k
        b = self.sbuf[p][k]
        b[:8].view(np.int32)[:] = (i, self.me)
        q = self.sreq[p][k].get(nb)
        if q is None:
            q = self.sreq[p][k][nb] = self.c.Send_init([b, nb, MPI.BYTE], p, self.tag)
        q.Start()
        return q

    def _recv(self, p, i, nb, spin):
        k = self.rptr[p]
        self.rptr[p] = 1 - k
        q, st = self.rreq[p][k], MPI.Status()
        self._wait(q, spin, f"receive from {p}, iteration {i}", st)
        got, h = st.Get_count(MPI.BYTE), self.rbuf[p][k][:8].view(np.int32).tolist()
        if h != [i, p] or got != nb:
            raise RuntimeError(f"[bare rank {self.me}] from {p}: header {h} and {got} bytes, "
                               f"expected [{i}, {p}] and {nb} bytes (iteration {i})")
        q.Start()
