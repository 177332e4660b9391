"""An ``mpiexec`` child job of this process, ended for sure.

``mpiexec -disable-auto-cleanup -n N <this python> -m MODULE ARGS`` starts in its own session
(a ^C reaches the script, not the ranks) with ``PR_SET_PDEATHSIG`` = SIGTERM (Linux), so the
job goes when the script dies, even by SIGKILL. Ending it: SIGTERM to ``mpiexec``, SIGKILL
after a grace period, then SIGKILL to any rank still there (MPICH gives each rank a session of
its own; their pids are ``track``ed). ``-disable-auto-cleanup``: a rank that exits leaves the
others running, so rank 0 can still report. Output is forwarded line by line to this
process's stderr, the last lines kept (``output_tail``). Invariant: the process is created and
waited for on a thread that lives as long as ``mpiexec`` (the parent-death signal follows the
thread that forked). docs/python_api.md, "Ranks started from a plain script"."""
from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from megainfer.engine.failures import CoreStartError
from megainfer.engine_core.launch_env import parent_death_signal

TAIL_LINES = 40
TERM_GRACE_S = 5.0


# a child job runs on this host alone: its ranks' transports listen on loopback only (a
# variable the caller set wins). MPICH's process manager (hydra) still binds its own PMI port
# on every interface: docs/serve.md, "Exposure".
LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo", "FI_SOCKETS_IFACE": "lo",
                "NCCL_SOCKET_IFNAME": "lo"}


def find_mpiexec() -> str:
    """The one rule for the MPI launcher (the library, perf/ and tests): ``$MPIEXEC`` when set
    (e.g. a GPU image's own MPICH), else ``mpiexec`` beside ``sys.executable`` (the same
    environment's MPICH), else on PATH."""
    named = os.environ.get("MPIEXEC")
    if named:
        if not os.access(named, os.X_OK):
            raise CoreStartError(f"MPIEXEC={named}: not an executable file")
        return named
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.access(here, os.X_OK) else shutil.which("mpiexec")
    if found is None:
        raise CoreStartError(f"no mpiexec beside {sys.executable} nor on PATH: starting the ranks "
                             "of a distributed deploy mode from a plain script needs MPICH "
                             "(`python -m pip install mpich`, next to mpi4py)")
    return found


def pid_alive(pid: int) -> bool:
    """``pid`` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill(0) said it is there


def _is_ours(pid: int, marker: str) -> bool:
    """``pid``'s command line still names ``marker`` (not a recycled pid); True without /proc."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc")
    except OSError:
        return False


class MpiexecJob:
    """``world`` ranks of ``python -m module *args`` under ``mpiexec``; ``marker``: a string of
    ``args`` unique to this job (it tells the job's rank processes from recycled pids)."""

    def __init__(self, world: int, module: str, args: Sequence[str], env: dict, marker: str):
        self.cmd = [find_mpiexec(), "-disable-auto-cleanup", "-n", str(world), sys.executable,
                    "-m", module, *args]
        self.env, self.marker = {**LOOPBACK_ENV, **env}, marker
        self.rank_pids: list[int] = []
        self.proc: Optional[subprocess.Popen] = None
        self.tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        self._spawn_error: Optional[BaseException] = None
        self._started = threading.Event()
        self._output_done = threading.Event()
        self._keeper = threading.Thread(target=self._keep, name="megainfer-mpiexec", daemon=True)
        self._keeper.start()
        self._started.wait()
        if self._spawn_error is not None:
            raise CoreStartError(f"could not start {' '.join(self.cmd)}: "
                                 f"{self._spawn_error}") from self._spawn_error

    def _keep(self) -> None:
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                preexec_fn=parent_death_signal(os.getpid()))
        except BaseException as e:  # noqa: BLE001 - raised by the constructor
            self._spawn_error = e
            return
        finally:
            self._started.set()
        try:
            for line in iter(self.proc.stdout.readline, b""):
                text = line.decode(errors="replace")
                self.tail.append(text)
                try:
                    sys.stderr.write(text)
                except (OSError, ValueError):  # the script's stderr is closed: keep the tail
                    pass
        finally:
            self._output_done.set()
            self.proc.wait()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def returncode(self) -> Optional[int]:
        """``mpiexec``'s exit status; None while it runs."""
        return self.proc.poll()

    def track(self, pids: Sequence[int]) -> None:
        self.rank_pids = list(pids)

    def dead_ranks(self) -> list[int]:
        """Indices (into ``track``'s pids) of the rank processes that are gone."""
        return [i for i, pid in enumerate(self.rank_pids) if not pid_alive(pid)]

    def output_tail(self, wait_s: float = 1.0) -> str:
        """The job's last output lines (waiting up to ``wait_s`` for the rest of it once it has
        exited)."""
        if self.returncode() is not None:
            self._output_done.wait(wait_s)
        return "".join(self.tail)

    def wait(self, timeout: Optional[float]) -> bool:
        """Wait for ``mpiexec`` to exit on its own; True when it did."""
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def end(self, grace_s: float = TERM_GRACE_S) -> None:
        """Stop the job now: SIGTERM to ``mpiexec`` (it ends its ranks), SIGKILL to all after
        ``grace_s``; every process of it gone when this returns (bounded)."""
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            if not self.wait(grace_s):
                self._signal_group(signal.SIGKILL)
                self.wait(grace_s)
        self.kill()

    def kill(self, wait_s: float = TERM_GRACE_S) -> None:
        """SIGKILL to ``mpiexec`` and every rank process still there (a broken job: nothing to
        wait for), waiting up to ``wait_s`` for them to be gone."""
        self._signal_group(signal.SIGKILL)
        for pid in self.rank_pids:  # mpiexec gone, a rank may not be (each has its own session)
            if pid_alive(pid) and _is_ours(pid, self.marker):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.wait(wait_s)
        deadline = time.monotonic() + wait_s
        while any(pid_alive(p) for p in self.rank_pids) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # its own session: the group is mpiexec's
        except (ProcessLookupError, PermissionError):
            pass
