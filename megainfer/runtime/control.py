"""The control plane between attention ranks: small Python objects (requests, finished outputs,
go/stop), sent point to point with bounded waits, so a dead or hung rank is noticed in bounded
time and named. Tensors never travel here (they use ``megainfer.comm``). The messages are
``messages.py``'s dataclasses; their tags ``tags.py``'s."""
from __future__ import annotations

from typing import Callable, Optional

from mpi4py import MPI

from megainfer.comm.errors import CommTimeoutError
from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.engine.failures import RankLostError


class RankFailure(RuntimeError):
    """A peer rank did not answer in time; names the rank and the phase."""

    def __init__(self, me: str, peer, phase: str, waited_s: float):
        who = "a peer rank" if peer is None else f"rank {peer}"
        super().__init__(f"{me}: {who} did not answer within {waited_s:.1f}s during {phase}; "
                         "aborting the job (finished results are on disk)")
        self.peer, self.phase = peer, phase


def silent_peer(e: BaseException, role_of: Callable[[int], Optional[str]]
                ) -> Optional[RankLostError]:
    """The peer that did not answer in time somewhere in ``e``'s chain (a ``RankFailure``'s or a
    channel's ``CommTimeoutError``'s ``peer``) as the ``RankLostError`` naming it, its role from
    ``role_of``; None when no peer is to blame."""
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, (RankFailure, CommTimeoutError)) and isinstance(cur.peer, int):
            return RankLostError.naming(cur.peer, role_of(cur.peer), f"stopped answering: {cur}")
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


class Outbox:
    """Object messages sent without waiting, on a communicator: for a peer that may be sending
    to this rank at the same time (a blocking send could wait on a receive that waits on it).
    Each ``post`` completes in the background; ``flush`` waits for all (small messages to live
    peers)."""

    def __init__(self, comm: MPI.Comm):
        self.comm, self.pending = comm, []

    def post(self, obj, dest: int, tag: int) -> None:
        self.pending = [r for r in self.pending if not r.Test()]
        self.pending.append(self.comm.isend(obj, dest=dest, tag=tag))

    def flush(self) -> None:
        MPI.Request.Waitall(self.pending)
        self.pending = []


class ControlPlane:
    """Timed object messages on a communicator (``me`` is the speaker's log label)."""

    def __init__(self, comm: MPI.Comm, me: str, policy: WaitPolicy):
        self.comm, self.me, self.policy = comm, me, policy

    def send(self, obj, dest: int, tag: int) -> None:
        self.comm.send(obj, dest=dest, tag=tag)

    def recv(self, src: int, tag: int, phase: str):
        status = MPI.Status()
        waited = wait_until(lambda: self.comm.Iprobe(source=src, tag=tag, status=status), self.policy)
        if waited < 0:
            raise RankFailure(self.me, src, phase, -waited)
        return self.comm.recv(source=src, tag=tag)

    def wait(self, req: MPI.Request, peer: int, phase: str) -> None:
        """Wait on an MPI request (e.g. a TP broadcast) with the same bound."""
        waited = wait_until(req.Test, self.policy)
        if waited < 0:
            raise RankFailure(self.me, peer, phase, -waited)
