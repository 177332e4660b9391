"""Start one MPI rank of a distributed job (``engine_core.builder`` calls it).

``build_rank`` picks the job's feature, the one named point where a mode beyond the base plugs
in (``FEATURES``: re-planning, ``replan.REPLAN``; prefill replicas, ``pd.PD``; each a
``rank_parts.Feature``), lets it refuse the job before anything collective, and builds the rank
through it or through the base start-up (``wiring.build_base_rank``). ``run_rank`` runs a
rank other than 0 the same way (rank 0 is the ``RuntimeEngine``'s). This is the only runtime
module that imports a feature: the base path (pipeline, replicas, tp, eplb, wiring, rank
parts) imports nothing from ``pd/`` or ``replan/``
(docs/architecture.md, "Runtime rooms").
"""
from __future__ import annotations

import sys
import time
from typing import Optional

from mpi4py import MPI

from megainfer.runtime.pd import PD
from megainfer.config import ResolvedJob
from megainfer.runtime.rank_parts import Feature, Rank
from megainfer.runtime.replan import REPLAN
from megainfer.runtime.span_report import ExpertSpanReporter, reports_spans
from megainfer.runtime.wiring import build_base_rank, run_base_rank

ABORT_GRACE_S = 0.5  # for mpiexec to forward a rank's last lines before MPI_Abort ends the job


def abort_job(comm, code: int) -> None:
    """End every rank of the job (a rank alone cannot leave it while the others may wait in a
    collective): what this rank printed is flushed and given ``ABORT_GRACE_S`` to reach
    ``mpiexec`` first (mpiexec drops what arrives after the abort)."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    comm.Abort(code)

def finish_job(who: str) -> int:
    """A rank whose part of the job ended well ends MPI now, while the interpreter still
    stands: 0, or 1 when ``MPI_Finalize`` failed (its error stack on stderr, ``who`` first).
    Left to mpi4py's hook at the very end of the interpreter's exit, a failed MPI_Finalize is
    silent, and the rank leaves without telling the process manager, which kills the job's other
    ranks (SIGKILL)."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return 0
    try:
        MPI.Finalize()
    except MPI.Exception as e:
        print(f"{who} MPI_Finalize failed: {e.Get_error_string()}", file=sys.stderr, flush=True)
        return 1
    return 0


# in this order: re-planning refuses a job with prefill replicas before PD would build it
FEATURES = (REPLAN, PD)


def feature_of(job: ResolvedJob) -> Optional[Feature]:
    """The first feature the job wants (None: the base start-up alone)."""
    return next((f for f in FEATURES if f.wants(job)), None)


def build_rank(job: ResolvedJob, comm=MPI.COMM_WORLD) -> Rank:
    """Collective: this rank's role, connections and parts."""
    feature = feature_of(job)
    if feature is not None and feature.check is not None:
        feature.check(job, comm.Get_size())  # every rank refuses alike
    if feature is not None and feature.build is not None:
        r = feature.build(job, comm)
    else:
        r = build_base_rank(job, comm, feature)
    r.feature = feature
    if reports_spans(job, r.role, r.tracer):  # traced on cpu: T_e reaches rank 0 as it runs
        r.expert_hooks.append(ExpertSpanReporter(r))
    return r


def run_rank(r: Rank) -> None:
    """A rank other than 0: serve rank 0 until it stops the job (rank 0 drives every rank
    from its ``RuntimeEngine``: ``runtime_engine.py``)."""
    assert r.role.rank != 0, "rank 0 runs its RuntimeEngine (engine_core.builder.start_ranks)"
    if r.feature is not None and r.feature.run is not None:
        r.feature.run(r)
    else:
        run_base_rank(r)
