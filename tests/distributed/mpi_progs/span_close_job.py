"""The served runtime's span reports at the job's end, under mpiexec (3 ranks).

    mpiexec -n 3 python span_close_job.py MODE
Ranks 1 and 2 report their expert spans to rank 0 (``ExpertSpanReporter``) at iterations 4 and
8, rank 0 reads them once in between (``PipelineSpans.take``); then ranks 1 and 2 send their
last report (``send_last_report``). MODE ``close``: rank 0 closes its reader
(``PipelineSpans.close``); ``skip``: it does not, and waits until both ranks' reports of
iteration 8 are there. Every rank then ends MPI (``startup.finish_job``) and prints
``finish <rank> <code>``: with ``skip`` rank 0's MPI_Finalize fails on the reports it left.
"""
import os
import sys
import time
from types import SimpleNamespace

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))

from mpi4py import MPI  # noqa: E402

from abort_on_error import run_or_abort  # noqa: E402

from megainfer.comm.wait import WaitPolicy  # noqa: E402
from megainfer.perfmodel.trace import EXPERT  # noqa: E402
from megainfer.runtime import tags  # noqa: E402
from megainfer.runtime.control import ControlPlane  # noqa: E402
from megainfer.runtime.span_report import (ExpertSpanReporter, PipelineSpans,  # noqa: E402
                                           send_last_report)
from megainfer.runtime.startup import finish_job  # noqa: E402


def _rank(comm):
    me = comm.Get_rank()
    r = SimpleNamespace(comm=comm, tracer=SimpleNamespace(events=[]), expert_hooks=[],
                        control=ControlPlane(comm, f"[rank {me}]", WaitPolicy(timeout_s=30)),
                        job=SimpleNamespace(trace=SimpleNamespace(enabled=True)))
    return r


def _span(it: int) -> dict:
    return {"cat": EXPERT, "name": "expert", "ts": 1e6 * it, "dur": 250.0,
            "args": {"iter": it, "layer": 0, "mb": 0}}


def main() -> None:
    mode = sys.argv[1]
    comm = MPI.COMM_WORLD
    me, r = comm.Get_rank(), _rank(comm)
    if me == 0:
        spans = PipelineSpans(r)
        comm.Barrier()  # iteration 4 reported
        while not all(comm.Iprobe(source=k, tag=tags.SERVE_SPANS) for k in (1, 2)):
            time.sleep(0.01)
        assert spans.take().expert_s == [2.5e-4] * 2, "the reports of iteration 4"
        comm.Barrier()  # read
        comm.Barrier()  # iteration 8 and the last reported
        if mode == "close":
            spans.close()
        else:
            while not all(comm.Iprobe(source=k, tag=tags.SERVE_SPANS) for k in (1, 2)):
                time.sleep(0.01)
            time.sleep(0.2)
    else:
        reporter = ExpertSpanReporter(r)
        r.expert_hooks.append(reporter)
        for it in (4, 8):
            r.tracer.events.append(_span(it))
            reporter(SimpleNamespace(iteration=it))
            if it == 4:
                comm.Barrier()  # reported
                comm.Barrier()  # rank 0 read them
        send_last_report(r)
        comm.Barrier()


if __name__ == "__main__":
    run_or_abort(main)
    me = MPI.COMM_WORLD.Get_rank()
    code = finish_job(f"[rank {me}]")
    print(f"finish {me} {code}", flush=True)
    sys.exit(code)
