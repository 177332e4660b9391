"""Where perf/'s parts live: the results folder, the job programs ``mpi_launch`` starts, and the
repository's conf/ (which a calibration may rewrite)."""
import os

PERF = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(PERF, "results")
JOBS = os.path.join(PERF, "jobs")
CONF = os.path.join(os.path.dirname(PERF), "conf")
