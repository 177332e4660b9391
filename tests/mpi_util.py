"""Run a Python script under real ``mpiexec`` processes from a test (hang = failure).

``run_mpi(nprocs, script, args, timeout)`` runs ``<venv>/bin/mpiexec -n K <python> script args``
with ``OMP_NUM_THREADS=1`` and raises ``AssertionError`` showing the tails of stdout and
stderr when the job times out or exits non-zero. mpiexec is looked up next to
``sys.executable`` (the venv's bin), so the job runs the same interpreter as pytest.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

TAIL = 3000


def mpiexec_path() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(path):
        raise FileNotFoundError(f"mpiexec not found next to {sys.executable} (install `mpich`)")
    return path


def _tail(text) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-TAIL:]


def run_mpi(nprocs: int, script: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, script, *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # own process group, so a timeout kills mpiexec and every rank it started
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"mpiexec -n {nprocs} {os.path.basename(script)} timed out after "
                             f"{timeout}s\n--- stdout tail ---\n{_tail(out)}\n"
                             f"--- stderr tail ---\n{_tail(err)}") from None
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if proc.returncode != 0:
        raise AssertionError(f"mpiexec -n {nprocs} {os.path.basename(script)} {' '.join(map(str, args))}"
                             f" exited {proc.returncode}\n--- stdout tail ---\n{_tail(proc.stdout)}"
                             f"\n--- stderr tail ---\n{_tail(proc.stderr)}")
    return proc
