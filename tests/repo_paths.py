"""Where the tests find the repository: its root, tests/, the mpiexec programs, perf/."""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
MPI_PROGS = os.path.join(TESTS, "distributed", "mpi_progs")  # the programs run_mpi starts
PERF = os.path.join(REPO, "perf")
