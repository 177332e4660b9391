"""Launch one perf/jobs/ program under this venv's mpiexec and read the JSON it writes.

    run_job(ranks, "pipeline_job.py", out_json, [args...]) -> the parsed JSON

One torch/OpenMP thread per rank; a failed or hung job raises with its command and the tail of
its stderr instead of stalling the benchmark.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from perf_paths import JOBS

from megainfer.core_client.mpiexec_job import find_mpiexec

MPIEXEC = find_mpiexec()  # $MPIEXEC, else the venv's (mpich wheel)


def run_ranks(cmd: list, timeout_s: int, capture: bool = False) -> subprocess.CompletedProcess:
    """Run an mpiexec command line in a session of its own. Past ``timeout_s`` kill the whole
    session, ranks included (``subprocess.run``'s timeout kills mpiexec alone and can leave
    stuck ranks spinning), then raise ``subprocess.TimeoutExpired``."""
    pipe = subprocess.PIPE if capture else None
    with subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, start_new_session=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1")) as p:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_job(ranks: int, script: str, out: str, args: list, timeout_s: int = 1800):
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, os.path.join(JOBS, script), out,
           *map(str, args)]
    p = run_ranks(cmd, timeout_s, capture=True)
    if p.returncode:
        raise RuntimeError(f"{script} failed ({' '.join(cmd)}):\n{p.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)
