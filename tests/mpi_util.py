"""Run a Python script under real ``mpiexec`` processes from a test (hang = failure).

``run_mpi(nprocs, script, args, timeout)`` runs ``<venv>/bin/mpiexec -n K <python> script args``
with ``OMP_NUM_THREADS=1`` and raises ``AssertionError`` showing the tails of stdout and
stderr, and each rank's error report, when the job times out or exits non-zero. Ranks report
through ``mpi_progs/abort_on_error.py`` into ``MPI_TEST_ERR_DIR`` (a fresh temporary folder per
job), since mpiexec may drop what a rank printed just before ``MPI_Abort``. mpiexec is looked
up next to ``sys.executable`` (the venv's bin), so the job runs the same interpreter as pytest.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

TAIL = 3000


def mpiexec_path() -> str:
    """The venv's mpiexec (the library's rule: ``core_client.mpiexec_job.find_mpiexec``)."""
    from megainfer.core_client.mpiexec_job import find_mpiexec
    return find_mpiexec()


def _tail(text) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-TAIL:]


def _rank_errors(err_dir: str) -> str:
    """Every rank's error report from ``err_dir``, in rank order."""
    out = []
    for n in sorted(os.listdir(err_dir), key=lambda n: int("".join(filter(str.isdigit, n)) or 0)):
        with open(os.path.join(err_dir, n)) as f:
            out.append(f.read())
    return "".join(out)


def run_mpi(nprocs: int, script: str, args: list, timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="mpi_errs_") as err_dir:
        return _run(nprocs, script, list(map(str, args)), timeout, err_dir)


def _run(nprocs: int, script: str, args: list[str], timeout: float, err_dir: str):
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MPI_TEST_ERR_DIR=err_dir)
    # own process group, so a timeout kills mpiexec and every rank it started
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        what = f"exited {p.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        what = f"timed out after {timeout}s"
    if p.returncode == 0:
        return subprocess.CompletedProcess(cmd, 0, out, err)
    raise AssertionError(f"mpiexec -n {nprocs} {os.path.basename(script)} {' '.join(args)} {what}\n"
                         f"--- rank errors ---\n{_rank_errors(err_dir)}"
                         f"--- stdout tail ---\n{_tail(out)}\n--- stderr tail ---\n{_tail(err)}")
