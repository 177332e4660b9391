"""Which rank of a spawned job is to blame when its engine core stops answering: a rank process
that is gone (its pid), an ``mpiexec`` that exited, or a rank 0 silent past ``comm.timeout_s``
(no output and no heartbeat: it hangs). Each answer is a ``RankLostError`` naming the rank and
its role."""
from __future__ import annotations

import time
from typing import Optional

from .errors import RankLostError
from .mpiexec_job import MpiexecJob
from .spawn_messages import RankInfo


class RankWatch:
    """``job``'s ranks (``RankInfo`` in rank order, their pids tracked by ``job``)."""

    def __init__(self, job: MpiexecJob, ranks: tuple[RankInfo, ...], timeout_s: float):
        self.job, self.ranks, self.timeout_s = job, ranks, timeout_s
        self.last_heard = time.monotonic()

    def heard(self) -> None:
        """Rank 0 sent something."""
        self.last_heard = time.monotonic()

    def dead_rank(self) -> Optional[RankInfo]:
        dead = self.job.dead_ranks()
        return self.ranks[dead[0]] if dead else None

    def lost(self, wait_s: float = 0.0) -> Optional[RankLostError]:
        """A rank (or mpiexec) that is gone, looking for up to ``wait_s``; None while all run."""
        end = time.monotonic() + wait_s
        while True:
            r = self.dead_rank()
            if r is not None:
                return RankLostError(f"rank {r.rank} {r.role} (pid {r.pid}) of the spawned job "
                                     "died", r.rank, r.role)
            rc = self.job.returncode()
            if rc is not None:
                return self.rank0(f"is gone: mpiexec exited with status {rc}")
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    def silent(self) -> Optional[RankLostError]:
        """Rank 0 when it has sent nothing for longer than ``timeout_s``."""
        silent = time.monotonic() - self.last_heard
        if silent <= self.timeout_s:
            return None
        return self.rank0(f"sent nothing (not even a heartbeat) for {silent:.1f}s, over "
                          f"comm.timeout_s={self.timeout_s:g}: it hangs")

    def rank0(self, what: str) -> RankLostError:
        role = self.ranks[0].role if self.ranks else None
        return RankLostError(f"rank 0 {role} of the spawned job {what}", 0, role)
