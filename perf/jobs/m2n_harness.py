"""The measuring tools of bench_m2n_mpi.py: barriers that do not spin, the interleaved timing
loop, and the ops it times (the channel's dispatch/combine, MPI_Alltoallv, bare persistent
requests, gloo all_to_all). Imported by the ranks of ``mpiexec -n 4 bench_m2n_mpi.py``.
"""
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from megainfer.comm import Channel, MessageSpec, WaitPolicy

torch.set_num_threads(1)
WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
ROW = 1024  # bytes per row: field x is float32 [256]
SPIN, BACKOFF, YIELD = WaitPolicy("spin"), WaitPolicy("backoff"), WaitPolicy("yield")
CORES = os.cpu_count() or 1


BARRIER_TIMEOUT_S = 300.0  # a barrier that waits longer means the run is stuck (docs/comm.md)


def _stuck(where: str):
    raise RuntimeError(f"[bench rank {RANK}] {where} waited over {BARRIER_TIMEOUT_S:.0f} s: the "
                       f"ranks are out of step (see docs/comm.md, 'The 2×2 hang')")


def idle_barrier(comm):
    req, t0 = comm.Ibarrier(), time.monotonic()
    while not req.Test():
        time.sleep(1e-3)
        if time.monotonic() - t0 > BARRIER_TIMEOUT_S:
            _stuck("idle barrier")


def on_sub(need: int, fn):
    """``fn(sub)`` on a sub-communicator of the first ``need`` world ranks (the others skip it),
    then an idle barrier of the whole world; returns ``fn``'s result (None on the others)."""
    sub = WORLD.Split(0 if RANK < need else MPI.UNDEFINED, RANK)
    out = None
    if sub != MPI.COMM_NULL:
        out = fn(sub)
        sub.Free()
    idle_barrier(WORLD)
    return out


def iters_for(size: int, scale: float) -> int:
    return max(10, int(min(200, (256 << 20) // size) * scale))


def yield_barrier(comm):
    """Synchronise without spinning a core flat out (MPI_Barrier spins; ranks > cores here)."""
    req = comm.Ibarrier()
    if req.Test():
        return
    t0, n = time.monotonic(), 0
    while not req.Test():
        os.sched_yield()
        n += 1
        if n % 4096 == 0 and time.monotonic() - t0 > BARRIER_TIMEOUT_S:
            _stuck("barrier before an op")


def timed_many(comm, n, ops: dict, warm: int = 2) -> dict:
    """Methods interleaved per iteration in a fresh random order (the same on every rank), so
    load drift hits all alike and each method follows each other one equally often (a spin
    wait leaves ranks behind in the scheduler, which would tax whatever always came next):
    barrier, time op on every rank; an iteration's time is the max over ranks."""
    local = {k: [] for k in ops}
    names = list(ops)
    for i in range(n + warm):
        for j in np.random.default_rng(i).permutation(len(names)):
            k = names[j]
            op = ops[k]
            yield_barrier(comm)
            t0 = time.perf_counter()
            op(i)
            dt = time.perf_counter() - t0
            if i >= warm:
                local[k].append(dt)
    out = {}
    for k, v in local.items():
        a = np.array(v)
        m = np.empty_like(a)
        comm.Allreduce(a, m, op=MPI.MAX)
        out[k] = m.tolist()
    return out


class P2P:
    """Dispatch (senders -> receivers) or combine through one Channel, payload pre-filled."""

    def __init__(self, t, senders, receivers, cap_rows):
        self.spec = MessageSpec.of(cap_rows, x=((ROW // 4,), torch.float32))
        self.ch = Channel(t, senders, receivers, self.spec, streams=1, depth=2)
        self.me, self.s, self.r = t.rank, senders, receivers

    def op(self, rows, policy, flat_first_polls=False):
        ch = self.ch

        def run(i):
            ch.policy = policy  # per run: several ops share this channel
            if flat_first_polls:  # ablation: a receive's first polls without sched_yield
                ch._fast_yield = False  # (what the channel did before; reset by the next run)
            if self.me in self.s:
                hs = [ch.post(ch.reserve(p, rows), iteration=i, layer=0, micro_batch=0) for p in self.r]
                for h in hs:
                    h.wait()
            if self.me in self.r:
                hs = [ch.recv(p, layer=0, micro_batch=0, iteration=i) for p in self.s]
                for h in hs:
                    h.wait().release()
        return run


def alltoallv_op(comm, senders, receivers, size):
    me, n = comm.Get_rank(), comm.Get_size()
    sc = [size if (me in senders and j in receivers) else 0 for j in range(n)]
    rc = [size if (me in receivers and j in senders) else 0 for j in range(n)]
    sd, rd = np.cumsum([0] + sc[:-1]).tolist(), np.cumsum([0] + rc[:-1]).tolist()
    sbuf, rbuf = np.ones(max(sum(sc), 1), np.uint8), np.empty(max(sum(rc), 1), np.uint8)
    return lambda i: comm.Alltoallv([sbuf, (sc, sd), MPI.BYTE], [rbuf, (rc, rd), MPI.BYTE])


def mpi_p2p_op(comm, senders, receivers, size, reqs_out: list):
    """The floor of any point-to-point layer written in Python: the same traffic (payload +
    the channel's 32-byte header) as bare mpi4py persistent requests, one ``Startall`` and a
    ``Testall``/``sched_yield`` loop per op; no header, ring or handle work."""
    me, n = comm.Get_rank(), size + 32
    reqs = [comm.Send_init([np.ones(n, np.uint8), n, MPI.BYTE], p, 9)
            for p in (receivers if me in senders else ())]
    reqs += [comm.Recv_init([np.empty(n, np.uint8), n, MPI.BYTE], p, 9)
             for p in (senders if me in receivers else ())]
    reqs_out += reqs
    start, test, yield_ = MPI.Prequest.Startall, MPI.Request.Testall, os.sched_yield

    def run(i):
        start(reqs)
        while not test(reqs):
            yield_()
    return run


def gloo_op(group, me, n, senders, receivers, size):
    sc = [size if (me in senders and j in receivers) else 0 for j in range(n)]
    rc = [size if (me in receivers and j in senders) else 0 for j in range(n)]
    sbuf, rbuf = torch.ones(sum(sc), dtype=torch.uint8), torch.empty(sum(rc), dtype=torch.uint8)
    return lambda i: dist.all_to_all_single(rbuf, sbuf, rc, sc, group=group)
