"""At a served job's end rank 0 receives every expert rank's span reports up to its last, so
MPI_Finalize finds no message left unreceived (MPICH's fails on one, and mpiexec then SIGKILLs
the job's other ranks); a failed MPI_Finalize is said and exits 1 (``startup.finish_job``)."""
import os
import re

import pytest

from mpi_util import run_mpi
from repo_paths import MPI_PROGS

PROG = os.path.join(MPI_PROGS, "span_close_job.py")


def test_rank0_receives_every_report_up_to_the_last():
    proc = run_mpi(3, PROG, ["close"], timeout=120)
    # (mpiexec may join the ranks' lines)
    assert sorted(re.findall(r"finish (\d) (\d)", proc.stdout)) == [("0", "0"), ("1", "0"),
                                                                      ("2", "0")]


def test_a_report_left_unreceived_fails_rank0s_finalize_loudly():
    with pytest.raises(AssertionError) as e:
        run_mpi(3, PROG, ["skip"], timeout=120)
    assert "[rank 0] MPI_Finalize failed" in str(e.value)
    assert "unmatched message" in str(e.value)
