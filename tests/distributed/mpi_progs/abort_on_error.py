"""Run a test job's ``main`` on one rank; on any exception, report it where the test can read it
and abort every rank (so the others do not wait for the test's timeout).

The report goes to stderr and, when ``run_mpi`` set ``MPI_TEST_ERR_DIR``, to
``$MPI_TEST_ERR_DIR/rank<N>.txt``. The file is the record the test relies on: a process manager
may drop what a rank printed just before ``MPI_Abort`` (seen once in CI: MPICH's mpiexec exited 1
with empty stdout and stderr although the rank had flushed its traceback).
"""
import os
import sys
import time
import traceback

from mpi4py import MPI

GRACE_S = 0.5  # lets mpiexec forward the stderr lines before the abort tears the job down


def run_or_abort(main) -> None:
    try:
        main()
    except SystemExit as e:  # a clean exit (LLM(deploy=...) ending a serving rank) is no failure
        if e.code not in (0, None):
            _abort()
        raise
    except BaseException:  # noqa: BLE001 -- any failure on any rank ends the whole job
        _abort()


def _abort() -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    text = f"rank {rank}: " + traceback.format_exc()
    sys.stderr.write(text)
    sys.stderr.flush()
    err_dir = os.environ.get("MPI_TEST_ERR_DIR")
    if err_dir:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(text)
    time.sleep(GRACE_S)
    MPI.COMM_WORLD.Abort(1)
