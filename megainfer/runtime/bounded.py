"""A re-plan's collective MPI calls (communicator duplication and split, the channels' set-up,
communicators freed), each bounded by ``comm.timeout_s`` and naming the late rank.

A blocking collective cannot time out: one rank hung before it keeps every other inside it.
``BoundedComm`` runs each such call on a helper thread (MPI runs ``MPI_THREAD_MULTIPLE``) while
the rank's thread waits, bounded. Just before the call every rank sends every other an arrival
token (``tags.ARRIVE``, first in, first out); when the bound passes the first peer whose token
did not come is named (``RankFailure``), or, every peer arrived, the call itself is said hung.
It stands in for the communicator where a callee makes collective calls itself: ``Dup``,
``Split`` and ``allgather`` are bounded, anything else is the communicator's own.
docs/replan.md, "Switch (`runtime/replan/switch.py`, `runtime/replan/requests.py`,
`runtime/replan/weights.py`)"."""
from __future__ import annotations

import threading

import numpy as np
import torch
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.runtime import tags
from megainfer.runtime.control import RankFailure


class BoundedComm:
    def __init__(self, comm: MPI.Comm, me: str, policy: WaitPolicy, phase: str):
        self.comm, self.me, self.policy, self.phase = comm, me, policy, phase

    def __getattr__(self, name):  # point-to-point and queries: the communicator's own
        return getattr(self.comm, name)

    def call(self, what: str, fn, *args, phase: str = None, scale: float = 1.0):
        """``fn(*args)``, a collective every rank of the communicator calls in the same order
        (a rank with nothing to do calls a no-op), bounded by ``scale`` times the policy's
        timeout. Returns its result; raises its exception, or ``RankFailure`` on time-out."""
        comm, phase = self.comm, f"{phase or self.phase} ({what})"
        me, n = comm.Get_rank(), comm.Get_size()
        peers = [k for k in range(n) if k != me]
        token = np.zeros(1, dtype=np.int8)
        got = np.empty(max(1, len(peers)), dtype=np.int8)
        sends = [comm.Isend(token, dest=k, tag=tags.ARRIVE) for k in peers]
        recvs = {k: comm.Irecv(got[i:i + 1], source=k, tag=tags.ARRIVE)
                 for i, k in enumerate(peers)}
        box: dict = {}
        cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def run():
            if cuda is not None:  # the current device is per thread: the caller's
                torch.cuda.set_device(cuda)
            try:
                box["out"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 -- re-raised on the rank's own thread
                box["err"] = e
        helper = threading.Thread(target=run, name=f"re-plan {what}", daemon=True)
        helper.start()
        arrived: set = set()

        def poll() -> bool:
            for k in peers:
                if k not in arrived and recvs[k].Test():
                    arrived.add(k)
            return not helper.is_alive() and len(arrived) == len(peers)
        policy = WaitPolicy(mode=self.policy.mode, timeout_s=self.policy.timeout_s * scale)
        waited = wait_until(poll, policy)
        if waited < 0:
            late = [k for k in peers if k not in arrived]
            if late:
                raise RankFailure(self.me, late[0], phase, -waited)
            raise RankFailure(self.me, None, phase + ", inside the call: every rank reached it",
                              -waited)
        helper.join()
        for req in sends:  # small: gone already, but every request is completed
            req.Wait()
        if "err" in box:
            raise box["err"]
        return box.get("out")

    # ------------------------------------------------------------------ what callees call
    def Dup(self, *args):
        return self.call("communicator duplication", self.comm.Dup, *args)

    def Split(self, color: int = 0, key: int = 0):
        return self.call("communicator split", self.comm.Split, color, key)

    def allgather(self, obj):
        return self.call("all-gather", self.comm.allgather, obj)

    def free(self, what: str, *comms) -> None:
        """Free ``comms`` (communicators this rank holds; None: none), as one bounded call."""
        def free_all():
            for c in comms:
                if c is not None and c != MPI.COMM_NULL:
                    c.Free()
        self.call(what, free_all)
