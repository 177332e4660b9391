"""Which rank of a spawned job is to blame when its engine core stops answering: a rank process
that is gone, an ``mpiexec`` that exited, or a rank 0 silent past ``comm.timeout_s`` (no
output and no heartbeat: it hangs). Each answer is a ``RankLostError`` naming the rank and its
role.

When one rank dies, MPICH ends the job's other ranks within milliseconds (their MPI library
finds the peer gone and aborts the job), so "which pid is gone" soon reads "all of them". The
watch therefore waits on a pidfd per rank (Linux 5.3+) together with the socket, and keeps the
order in which the ranks were seen to die: the first is the one to blame. Where pidfds do not
exist it falls back to polling the pids (the lowest dead rank is blamed).
"""
from __future__ import annotations

import os
import select
import time
from typing import Optional

from megainfer.engine.failures import RankLostError

from .mpiexec_job import MpiexecJob
from megainfer.engine_core.messages import RankInfo


class RankWatch:
    """``job``'s ranks (``RankInfo`` in rank order, their pids tracked by ``job``)."""

    def __init__(self, job: MpiexecJob, ranks: tuple[RankInfo, ...], timeout_s: Optional[float]):
        self.job, self.ranks, self.timeout_s = job, ranks, timeout_s
        self.last_heard = time.monotonic()
        self.died: list[int] = []  # rank indices, in the order they were seen to die
        self.pidfds: dict[int, int] = {}  # pidfd -> rank index, for the ranks not seen dead
        for i, r in enumerate(ranks):
            try:
                self.pidfds[os.pidfd_open(r.pid)] = i
            except (AttributeError, OSError):  # no pidfds here, or the rank is gone already
                pass

    def heard(self) -> None:
        """Rank 0 sent something."""
        self.last_heard = time.monotonic()

    def wait(self, fd: Optional[int], timeout_s: float) -> bool:
        """Until ``fd`` is readable (True), a rank dies or ``timeout_s`` passes (False)."""
        poller = select.poll()
        for f in self.pidfds:
            poller.register(f, select.POLLIN)
        if fd is not None:
            poller.register(fd, select.POLLIN)
        ready, newly = False, []
        for f, _ in poller.poll(timeout_s * 1000):
            if f == fd:
                ready = True
            elif f in self.pidfds:
                newly.append(self.pidfds.pop(f))
                os.close(f)
        self.died += sorted(newly)  # seen in one wake-up: no telling which went first
        return ready

    def lost(self, wait_s: float = 0.0) -> Optional[RankLostError]:
        """A rank (or mpiexec) that is gone, looking for up to ``wait_s``; None while all run."""
        end = time.monotonic() + wait_s
        while True:
            dead = self.died + [i for i in self.job.dead_ranks() if i not in self.died]
            if dead:
                r = self.ranks[dead[0]]
                also = ", ".join(f"rank {self.ranks[i].rank}" for i in dead[1:])
                return RankLostError.naming(
                    r.rank, r.role,
                    f"(pid {r.pid}) died" + (f" ({also} then ended with it)" if also else ""))
            rc = self.job.returncode()
            if rc is not None:
                return self.rank0(f"is gone: mpiexec exited with status {rc}")
            left = end - time.monotonic()
            if left <= 0:
                return None
            self.wait(None, min(left, 0.05))

    def silent(self) -> Optional[RankLostError]:
        """Rank 0 when it has sent nothing for longer than ``timeout_s`` (None: not watched)."""
        silent = time.monotonic() - self.last_heard
        if self.timeout_s is None or silent <= self.timeout_s:
            return None
        return self.rank0(f"sent nothing (not even a heartbeat) for {silent:.1f}s, over "
                          f"comm.timeout_s={self.timeout_s:g}: it hangs")

    def rank0(self, what: str) -> RankLostError:
        role = self.ranks[0].role if self.ranks else None
        return RankLostError.naming(0, role, what)

    def close(self) -> None:
        for f in self.pidfds:
            os.close(f)
        self.pidfds.clear()
