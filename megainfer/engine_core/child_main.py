"""``mpiexec -n N python -m megainfer.engine_core.child_main ADDRESS``: the ranks a
``ChildJobClient`` starts from a plain script.

Rank 0 connects to the script's unix socket ``ADDRESS`` (authkey in ``$MEGAINFER_CORE_AUTHKEY``),
receives the ``JobTree`` and broadcasts it; every rank resolves its own job, reports to rank 0
(``Launched``) and builds its part (``builder.start_ranks``). Rank 0 runs the engine core on a
thread (``EngineCoreThread``), sends ``Ready`` and relays inputs and outputs; the socket's end
is a ``Shutdown``. The other ranks serve rank 0 until it closes and exit 0. A failure before
``Launched`` aborts the whole job; after it, the failing rank logs its traceback and exits 1 at
once (no ``MPI_Finalize``). Errors sent to the script are ``EngineDeadError``s.
docs/python_api.md, "Ranks started from a plain script".
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Client

from mpi4py import MPI

from megainfer.engine.failures import CoreStartError, EngineDeadError, RankLostError
from megainfer.engine.stats import core_hangs
from megainfer.runtime.control import silent_peer
from megainfer.runtime.roles import assign_role
from megainfer.runtime.startup import abort_job, finish_job

from .builder import start_ranks
from .core import EngineCore
from .core import EngineCoreThread
from .launch_env import parent_death_signal
from .messages import (AUTHKEY_ENV, HEARTBEAT_S, LOG_LEVEL_ENV, AbortRequest, AddRequest,
                       CoreOutputs, Heartbeat, Launched, OrderReplan, Ready, Shutdown,
                       StartFailed, gather_roster)

log = logging.getLogger("megainfer.engine_core")
POLL_S = 0.25  # rank 0's main thread: how often it checks its core thread while no input comes


def wire_error(e: BaseException, ranks: dict, what: str = "rank 0's engine core died"):
    """``e`` as the ``EngineDeadError`` the script gets: one already (the runtime's engine
    names a silent peer itself: ``RankLostError``) as it is; a peer that did not answer in time
    anywhere else in its chain (e.g. while the ranks start) named by ``control.silent_peer``
    (``ranks``: rank -> ``RankInfo``); anything else by its type and message."""
    if isinstance(e, EngineDeadError):
        return e
    lost = silent_peer(e, lambda r: ranks[r].role if r in ranks else None)
    if lost is not None:
        return lost
    return EngineDeadError(f"{what}: {type(e).__name__}: {e} (its traceback is in the job's "
                           "log)")


class _Outbox:
    """Rank 0's side of the socket for sending: one lock, and a script that is gone is not an
    error (the main thread sees the end of the socket and shuts the core down)."""

    def __init__(self, conn, ranks: dict):
        self.conn, self.ranks, self.lock = conn, ranks, threading.Lock()
        self.last_sent = time.monotonic()

    def send(self, msg, timeout: float = -1) -> None:
        """``timeout``: give up (the message dropped) when the lock is not free by then."""
        if not self.lock.acquire(timeout=timeout):
            log.debug("the socket stays busy; dropped %s", type(msg).__name__)
            return
        try:
            self.conn.send(msg)
            self.last_sent = time.monotonic()
        except (OSError, EOFError):
            log.debug("the script is gone; dropped %s", type(msg).__name__)
        finally:
            self.lock.release()

    def heartbeat(self) -> None:
        if time.monotonic() - self.last_sent >= HEARTBEAT_S:
            self.send(Heartbeat())

    def deliver(self, outputs) -> None:  # EngineCoreThread's callback, on its thread
        if outputs.error is not None:
            outputs = CoreOutputs(outputs.updates, wire_error(outputs.error, self.ranks),
                                  outputs.stats)
        try:
            self.send(outputs)
        except Exception as e:  # noqa: BLE001 - an output that does not pickle: say so
            self.send(CoreOutputs(error=EngineDeadError(f"rank 0 could not send its outputs: "
                                                        f"{type(e).__name__}: {e}")))


def serve_script(conn, engine, job, ranks: dict, prefix: str) -> bool:
    """Rank 0: the core over ``engine`` until a ``Shutdown`` or the socket's end; True when the
    core ended cleanly."""
    out = _Outbox(conn, ranks)
    out.send(Ready(engine.log_prefix, float(job.comm.timeout_s)))  # before any output
    core = EngineCoreThread(EngineCore(engine), out.deliver)
    log.info("%s serving the script's engine core", prefix)
    hang_s = engine.hang_after_s(float(job.comm.timeout_s))
    while core.alive:
        hangs = core_hangs(core.busy_s(), hang_s)
        if hangs is not None:
            _hung(out, ranks, prefix, hangs)
            return False
        out.heartbeat()
        try:
            if not conn.poll(POLL_S):
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            log.warning("%s the script closed its socket: shutting down", prefix)
            core.submit(Shutdown())
            break
        if not isinstance(msg, (AddRequest, AbortRequest, OrderReplan, Shutdown)):
            log.error("%s ignored %r: not an engine core input", prefix, msg)
            continue
        core.submit(msg)
        if isinstance(msg, Shutdown):
            break
    core.thread.join()
    return core.error is None


def _hung(out: _Outbox, ranks: dict, prefix: str, hangs: str) -> None:
    """The core thread is stuck inside one round (while this thread, alive, would go on
    sending heartbeats): tell the script, naming rank 0; the caller then ends this process."""
    role = ranks[0].role if 0 in ranks else None
    err = RankLostError.naming(0, role, hangs)
    log.error("%s %s", prefix, err)
    out.send(CoreOutputs(error=err), timeout=1.0)


def _launch(rank: int, world: int, comm, spec):
    """(this rank's job, {rank: RankInfo} on rank 0, role label); ``spec``: rank 0's
    ``JobTree`` (None on the others)."""
    spec = comm.bcast(spec, root=0)
    job = spec.resolve(rank)
    label = assign_role(job.deploy, rank, world).label
    ranks = {i.rank: i for i in gather_roster(comm, label)}
    return job, ranks, label


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    arm = parent_death_signal(os.getppid())  # the MPI proxy gone: this rank goes too
    if arm is not None:
        arm()
    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV, "WARNING"), format="%(message)s")
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    prefix, conn, ranks, launched = f"[rank {rank}]", None, {}, False
    try:
        if rank == 0:
            if len(argv) != 1:
                raise CoreStartError(f"child_main: give the script's socket address, got {argv!r}")
            conn = Client(argv[0], family="AF_UNIX",
                          authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
        os.environ.pop(AUTHKEY_ENV, None)
        job, ranks, prefix = _launch(rank, world, comm, conn.recv() if conn else None)
        if rank == 0:
            conn.send(Launched(tuple(ranks[r] for r in sorted(ranks))))
        launched = True
        engine = start_ranks(job)  # (this rank's threads set there)
    except BaseException as e:  # noqa: BLE001 - every start failure ends this rank
        log.exception("%s failed to start", prefix)
        if conn is not None:
            try:
                conn.send(StartFailed(wire_error(e, ranks, f"{prefix} failed to start")))
            except (OSError, EOFError):
                pass
        _end(comm, launched, 1)
        return 1  # not reached: _end exits
    if engine is None:  # a rank other than 0: it served until rank 0 closed
        log.debug("%s the job is over", prefix)
        return finish_job(prefix)
    try:
        clean = serve_script(conn, engine, job, ranks, prefix)
    except BaseException:  # noqa: BLE001
        log.exception("%s serving the script failed", prefix)
        clean = False
    conn.close()
    if not clean:
        _end(comm, True, 1)  # peers may be lost: no MPI_Finalize
    return finish_job(prefix)


def _end(comm, launched: bool, code: int) -> None:
    """Exit now with ``code``: before every rank has launched, abort the job (the others may
    wait in a start-up collective); after, this process alone (the script names it)."""
    if not launched:
        abort_job(comm, code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
