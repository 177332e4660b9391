"""A ``megainfer-serve`` job as a subprocess of a benchmark: one process, or ``mpiexec -n N``
(its own session; SIGTERM drains it), until it prints its address; its ranks' pids (from rank 0's
``[serve] ranks:`` line) and their CPU seconds (Linux ``/proc``)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from megainfer.bench.process_cpu import cpu_seconds
from megainfer.engine_core.messages import parse_roster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A megainfer-serve job (one process, or ``mpiexec -n ranks``) until it listens;
    ``pids``: its ranks' processes (rank order)."""

    def __init__(self, ranks: int, overrides: list[str], mpiexec: str):
        self.port = free_port()
        cmd = [sys.executable, "-m", "megainfer.launch.serve", f"serve.port={self.port}",
               *overrides, "hydra.run.dir=.", "hydra.output_subdir=null",
               "hydra/job_logging=none", "hydra/hydra_logging=none"]
        if ranks > 1:
            cmd = [mpiexec, "-n", str(ranks), *cmd]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self.pids, line = [self.proc.pid], ""
        while " on http://" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise SystemExit(f"server ({' '.join(overrides)}) exited before serving")
            if line.startswith("[serve] ranks: "):  # a plain process is the frontend itself
                roster = parse_roster(line)
                self.pids = ([self.proc.pid] if ranks == 1 else []) + \
                    [roster[r].pid for r in sorted(roster)]

    def cpu_s(self) -> list[float]:
        return [cpu_seconds(p) for p in self.pids]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)  # mpiexec forwards it: rank 0 drains
        try:
            return self.proc.wait(120)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
