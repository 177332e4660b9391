"""Run a perf/ script end to end, as a user would: ``python perf/<folder>/<script>.py args``, in a
subprocess (perf/ is a folder of scripts, not a package; what tests check of their arithmetic
lives in ``megainfer.bench``)."""
import os
import subprocess
import sys

from repo_paths import PERF



def perf_script(path: str) -> str:
    """``path`` under perf/, e.g. "jobs/workload_job.py" -> its absolute path."""
    return os.path.abspath(os.path.join(PERF, path))


def run_perf(path: str, args: list, timeout: int = 600) -> str:
    """Run perf/<path> with ``args`` (one torch thread); its stdout. A failure raises with the
    script's stderr."""
    p = subprocess.run([sys.executable, perf_script(path), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, f"perf/{path} exited {p.returncode}:\n{p.stderr[-3000:]}"
    return p.stdout
