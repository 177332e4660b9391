"""The engine core of a deploy mode started from a plain ``python script.py``: an ``mpiexec``
child job (``engine_core.child_main``) whose rank 0 serves the core over a local socket.

``ChildJobClient(spec, deliver)`` listens on a private unix socket (``CoreSocket``: a random
authkey in the child's environment; one authenticated connection, then the socket is removed),
starts the job (``MpiexecJob``), sends rank 0 the ``JobTree`` and blocks until ``Ready``
(bounded: else ``CoreStartError`` with the job's last output lines, the job ended). A reader
thread hands each ``CoreOutputs`` to ``deliver`` and watches the ranks (``RankWatch``): a dead
rank ends the job as ``CoreOutputs(error=RankLostError(...))``; a rank 0 silent for
``comm.timeout_s`` is declared hung. ``shutdown()``, garbage collection, interpreter exit and
SIGTERM (over the default handler only) all end the job the same way, leaving no process.
docs/python_api.md, "Ranks started from a plain script"."""
from __future__ import annotations

import copy
import logging
import os
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Callable, Optional

from megainfer.engine_core.core import SHUTDOWN_TIMEOUT_S
from megainfer.engine.failures import CoreStartError, EngineDeadError
from megainfer.engine_core.messages import (AUTHKEY_ENV, LOG_LEVEL_ENV, AddRequest, CoreInput,
                                            CoreOutputs, Heartbeat, Launched, RankInfo, Ready,
                                            Shutdown, StartFailed, roster_text)

from . import sigterm_exit
from .core_socket import CoreSocket
from .mpiexec_job import MpiexecJob
from .rank_watch import RankWatch

log = logging.getLogger("megainfer.core_client")

START_TIMEOUT_S = 600.0  # starting N ranks: imports, MPI start-up, weights (a slow disk, a big model)
WATCH_S = 0.25  # how often the reader checks the ranks' pids while no output comes
# the variables a launcher gives its processes must not reach the child job's mpiexec (this
# script may be one of them); MPICH's own settings (MPIR_CVAR_*, HYDRA_*) do reach the ranks
_LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "OMPI_COMM_WORLD_", "HYDI_", "MPI_LOCAL")


class ChildJobClient:
    """A ``CoreClient`` over an ``mpiexec`` child job of ``spec.world_size`` ranks.
    ``deliver`` gets each ``CoreOutputs`` on the reader thread (hand them on, do no work; it
    must not hold this object, or garbage collection cannot end the job). ``ranks``: each
    rank's (rank, pid, role)."""

    def __init__(self, spec, deliver: Callable[[CoreOutputs], None],
                 start_timeout_s: float = START_TIMEOUT_S):
        self._link = _Link(spec, deliver)
        self._finalizer = weakref.finalize(self, self._link.close, SHUTDOWN_TIMEOUT_S)
        try:
            self._link.start(start_timeout_s)
        except BaseException:
            self._finalizer()
            raise

    @property
    def alive(self) -> bool:
        return self._link.alive

    engine = None  # the engine lives in the child job

    @property
    def ranks(self) -> tuple[RankInfo, ...]:
        return self._link.ranks

    def busy_s(self) -> float:
        return 0.0  # rank 0 of the child job watches its own core (``child_main``)

    @property
    def job(self) -> MpiexecJob:
        return self._link.job

    def submit(self, msg: CoreInput) -> None:
        """An ``AddRequest`` raises ``EngineDeadError`` (``RankLostError``: the rank to blame)
        once the core is gone (nothing would answer); an abort or a shutdown then does
        nothing."""
        self._link.submit(msg)

    def shutdown(self, timeout: Optional[float] = None) -> None:
        if self._finalizer.detach() is not None:
            self._link.close(SHUTDOWN_TIMEOUT_S if timeout is None else timeout)

    def __enter__(self) -> "ChildJobClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class _Link:
    """The socket to rank 0 and the job behind it (no reference to the ``ChildJobClient``, so
    that the core can be collected while the reader runs)."""

    def __init__(self, spec, deliver):
        self.spec, self.deliver = spec, deliver
        self.job: Optional[MpiexecJob] = None
        self.conn: Optional[Connection] = None
        self.ranks: tuple[RankInfo, ...] = ()
        self.error: Optional[EngineDeadError] = None
        self.watch: Optional[RankWatch] = None  # once every rank has launched
        self.closing = self.closed = False
        self.send_lock, self.state_lock = threading.Lock(), threading.Lock()
        self.reader: Optional[threading.Thread] = None
        self.socket = CoreSocket()
        self.who = f"[script pid {os.getpid()}]"

    # -- start ------------------------------------------------------------------------------
    def start(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        world = self.spec.world_size
        address = self.socket.address
        env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV_PREFIXES)}
        env.update({AUTHKEY_ENV: self.socket.authkey.hex(), "PYTHONUNBUFFERED": "1",
                    LOG_LEVEL_ENV: logging.getLevelName(
                        logging.getLogger("megainfer").getEffectiveLevel())})
        self.job = MpiexecJob(world, "megainfer.engine_core.child_main", [address], env,
                              marker=address)
        sigterm_exit.hold()
        log.info("%s started %d ranks: %s (pid %d)", self.who, world, " ".join(self.job.cmd),
                 self.job.pid)
        self.conn = self.socket.accept(lambda: self._check_starting(deadline, "rank 0 connected"),
                                       WATCH_S)
        try:
            self.conn.send(self.spec)
        except OSError:
            raise self._start_error("rank 0 closed its socket before it got the job") from None
        while True:
            msg = self._start_message(deadline)
            if isinstance(msg, Launched):
                self.ranks = msg.ranks
                self.job.track([r.pid for r in msg.ranks])
                self.watch = RankWatch(self.job, self.ranks, timeout_s=None)
            elif isinstance(msg, StartFailed):
                raise self._start_error(f"{msg.error}") from msg.error
            elif isinstance(msg, Ready) and self.watch is not None:
                self.watch.timeout_s = msg.timeout_s
                break
            else:
                raise self._start_error(f"rank 0 sent {type(msg).__name__} before Ready")
        log.info("%s ranks ready: %s", self.who, roster_text(self.ranks))
        self.reader = threading.Thread(target=self._read, name="megainfer-spawned-core",
                                       daemon=True)
        self.reader.start()

    def _start_message(self, deadline: float):
        while True:
            self._check_starting(deadline, "the ranks were ready")
            try:
                if self._wait(WATCH_S):
                    return self.conn.recv()
            except (EOFError, OSError):
                raise self._start_error("rank 0 closed its socket before it was ready") from None

    def _wait(self, timeout_s: float) -> bool:
        """Until rank 0 sent something (True), a rank died or ``timeout_s`` passed."""
        if self.watch is None:
            return self.conn.poll(timeout_s)
        return self.watch.wait(self.conn.fileno(), timeout_s)

    def _check_starting(self, deadline: float, until: str) -> None:
        lost = self.watch.lost() if self.watch is not None else None
        if lost is not None:
            raise self._start_error(f"{lost} before {until}") from lost
        rc = self.job.returncode()
        if rc is not None:
            raise self._start_error(f"mpiexec exited with status {rc} before {until}")
        if time.monotonic() > deadline:
            raise self._start_error(f"timed out before {until}")

    def _start_error(self, reason: str) -> CoreStartError:
        """The typed start failure, the job ended first (so its output is complete)."""
        if self.job is not None:
            self.job.end()
        tail = self.job.output_tail() if self.job is not None else ""
        return CoreStartError(f"the {self.spec.world_size} rank(s) of the spawned job did not "
                              f"start: {reason}\n--- the job's last output lines ---\n{tail}")

    # -- running ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return (self.reader is not None and self.error is None and not self.closing
                and self.job.returncode() is None)

    def submit(self, msg: CoreInput) -> None:
        if self.error is not None or self.closing or self.conn is None:
            if not isinstance(msg, AddRequest):
                return  # an abort or a shutdown of a core that is gone: done already
            if self.error is not None:
                raise copy.copy(self.error)
            raise EngineDeadError("the spawned engine core is shut down")
        try:
            with self.send_lock:
                self.conn.send(msg)
        except (OSError, EOFError) as e:
            raise self.error or EngineDeadError(f"the spawned engine core is gone: {e}") from e

    def _read(self) -> None:
        """The reader thread: outputs to ``deliver``, the ranks watched, until the socket ends."""
        try:
            while True:
                try:
                    msg = self.conn.recv() if self._wait(WATCH_S) else None
                except (EOFError, OSError):
                    break
                if msg is None:
                    lost = self.watch.lost() or self.watch.silent()
                    if lost is not None and not self.closing:
                        if self.conn.poll(0):  # its last words came just before its end:
                            continue  # read them first (rank 0's own error names the cause)
                        self._fail(lost)
                        return
                    continue
                self.watch.heard()
                if isinstance(msg, CoreOutputs):
                    if msg.error is not None:
                        self._died(msg)
                        return
                    self._deliver(msg)
                elif not isinstance(msg, Heartbeat):
                    log.warning("%s ignored %r from rank 0", self.who, msg)
            if not self.closing:  # rank 0's socket ended on its own: name who is to blame
                self._fail(self.watch.lost(wait_s=1.0) or self.watch.rank0("closed its socket"))
        except BaseException as e:  # noqa: BLE001 - a broken reader must not leave a silent core
            log.exception("%s the spawned core's reader failed", self.who)
            self._fail(EngineDeadError(f"the spawned core's reader failed: {e!r}"))

    def _deliver(self, outputs: CoreOutputs) -> None:
        try:
            self.deliver(outputs)
        except Exception:  # noqa: BLE001 - the frontend's bug: the core goes on
            log.exception("%s deliver callback raised", self.who)

    def _died(self, last: CoreOutputs) -> None:
        """The core reported its death (``last.error``): no input is taken from now on, the
        frontend is told, the job ends (after a moment for its last log lines)."""
        err = last.error
        self.error = err if isinstance(err, EngineDeadError) else EngineDeadError(str(err))
        log.error("%s the spawned engine core died: %s", self.who, err)
        self._deliver(last)
        if not self.job.wait(1.0):
            self.job.kill()

    def _fail(self, error: EngineDeadError) -> None:
        """A rank is lost: tell the frontend, kill the job (nothing is left waiting)."""
        self.error = error
        self._deliver(CoreOutputs(error=error))
        self.job.kill()
        log.error("%s %s\n--- the job's last output lines ---\n%s", self.who, error,
                  self.job.output_tail())

    # -- end --------------------------------------------------------------------------------
    def close(self, timeout: float) -> None:
        """Shutdown, the last outputs, the job's exit, all within ``timeout``; then the job is
        ended whatever its state. Idempotent; callable from any thread (also the reader's)."""
        with self.state_lock:
            if self.closed:
                return
            self.closed = self.closing = True
        deadline = time.monotonic() + timeout
        try:
            if self.reader is not None and self.error is None:  # it runs: a clean end first
                try:
                    with self.send_lock:
                        self.conn.send(Shutdown())
                except (OSError, EOFError):
                    pass
                if self.reader is not threading.current_thread():
                    self.reader.join(max(0.0, deadline - time.monotonic()))
                self.job.wait(max(0.0, deadline - time.monotonic()))
            if self.job is not None:
                self.job.end()
        finally:
            if self.conn is not None:
                self.conn.close()
            self.socket.close()
            if self.watch is not None:
                self.watch.close()
            if self.job is not None:
                sigterm_exit.release()
