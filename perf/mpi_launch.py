"""Launch one perf/ job under this venv's mpiexec and read the JSON it writes.

    run_job(ranks, "pipeline_job.py", out_json, [args...]) -> the parsed JSON

One torch/OpenMP thread per rank; a failed or hung job raises with its command and the tail of
its stderr instead of stalling the benchmark.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")  # the venv's (mpich wheel)


def run_job(ranks: int, script: str, out: str, args: list, timeout_s: int = 1800):
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, os.path.join(HERE, script), out,
           *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode:
        raise RuntimeError(f"{script} failed ({' '.join(cmd)}):\n{p.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)
