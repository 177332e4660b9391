"""``megainfer-launch`` under mpirun: every rank builds its part (``engine_core.builder.build_ranks``);
rank 0 runs the offline job through the same client -> engine core -> engine route as ``LLM``
(``core_client.client.launch_client``) and writes the results, the summary and (with
``trace.enabled``) the merged trace, its ``timeline.png`` and pipeline figures into its run
directory.

A rank that fails prints one line naming itself, the peer and the phase, writes it with its
traceback to ``<run dir>/error.rank<N>.txt``, then aborts the whole job: every line already
written stays on disk, and rerunning the same command resumes. A rank that dies outright is
reported by the process manager; rank 0's start-up line maps each pid to its rank and role.
This module starts MPI when imported: single mode never imports it.
docs/engine.md, "Bad input" (start-up and rank failures)."""
from __future__ import annotations

import json
import logging
import os
import sys
import traceback

from mpi4py import MPI

from megainfer.core_client.client import launch_client
from megainfer.engine_core.builder import build_ranks, serve_rank0
from megainfer.engine_core.messages import gather_roster, roster_text
from megainfer.engine.failures import RankLostError
from megainfer.runtime.roles import assign_role
from megainfer.runtime.startup import abort_job
from megainfer.runtime.trace import merge_traces
from megainfer.runtime.trace_metrics import pipeline_metrics
from megainfer.tools.timeline import PlotExtraMissing, draw_timeline

from .job import run_offline_job, write_summary

log = logging.getLogger("megainfer.launch")


def run_distributed(s, requests, output_path: str, run_dir: str) -> int:
    comm = MPI.COMM_WORLD
    run_dir = comm.bcast(run_dir, root=0)  # rank 0's Hydra run directory is the job's
    output_path = comm.bcast(output_path, root=0)
    label = f"[rank {comm.Get_rank()}]"
    try:
        label = assign_role(s.deploy, comm.Get_rank(), comm.Get_size()).label
        rank = build_ranks(s, comm)
        ranks = gather_roster(comm, label)
        if ranks:  # so a process manager's "PID n died" can be read as a rank and role
            log.info("[launch] ranks: %s", roster_text(ranks))
        if comm.Get_rank() == 0:  # the one route: client -> engine core -> rank 0's engine
            client = launch_client(rank)
            summary = run_offline_job(requests, client, output_path, resume=s.io.resume,
                                      progress=s.io.progress)
            client.close()  # the last iteration stops every rank; its connections closed
            summary.replans = rank.replans  # re-plans of the split, if any
        else:
            serve_rank0(rank)  # until that last iteration; then its connections closed
        if s.trace.enabled:
            _write_traces(rank, comm, run_dir, summary if comm.Get_rank() == 0 else None)
        if comm.Get_rank() == 0:
            print(f"[launch] summary ({s.deploy.mode}, {comm.Get_size()} ranks)\n{summary.table()}",
                  flush=True)
            write_summary(summary, os.path.join(run_dir, "summary.json"))
        return 0
    except Exception as e:  # noqa: BLE001 -- any failure on any rank ends the whole job
        if isinstance(e, RankLostError) and e.__cause__ is not None:
            e = e.__cause__  # the failure where it happened (a timeout names peer and phase)
        _report_failure(f"{label} error: {type(e).__name__}: {e}", run_dir, comm.Get_rank())
        abort_job(comm, 1)
        return 1


def _report_failure(line: str, run_dir: str, rank: int) -> None:
    """Print ``line``, keep it with the traceback in ``run_dir/error.rank<rank>.txt``."""
    path = os.path.join(run_dir, f"error.rank{rank}.txt")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(line + "\n\n" + traceback.format_exc())
        line += f" (traceback: {path})"
    except OSError as err:  # the report must not hide the failure it reports
        line += f" (could not write {path}: {err})"
    print(line, file=sys.stderr, flush=True)


def _write_traces(rank, comm, run_dir: str, summary) -> None:
    """Each rank writes its trace; rank 0 merges them, puts the pipeline figures into the
    summary (``summary.pipeline``, printed too) and draws ``timeline.png`` of a steady-state
    iteration (``megainfer.tools.timeline``; without matplotlib the log names the extra)."""
    rank.tracer.write(run_dir)
    comm.Barrier()
    if comm.Get_rank() != 0:
        return
    paths = [os.path.join(run_dir, f"trace.rank{r}.json") for r in range(comm.Get_size())]
    merged = merge_traces(paths, os.path.join(run_dir, "trace.json"))
    with open(merged) as f:
        m = pipeline_metrics(json.load(f))
    print(f"[launch] pipeline (from {merged}): T_a {m['T_a_us']:.0f} us, T_e {m['T_e_us']:.0f} us, "
          f"T_c {m['T_c_us']:.0f} us, communication hidden {100 * m['hidden_fraction']:.0f}%, "
          f"bubbles {m['bubble_fraction']}", flush=True)
    summary.pipeline = {k: _json_number(v) for k, v in m.items()}
    png = os.path.join(run_dir, "timeline.png")
    try:
        it, _ = draw_timeline(merged, png)
    except PlotExtraMissing as e:
        log.warning("[launch] no timeline.png: %s", e)
        return
    summary.pipeline.update(timeline=png, timeline_iteration=it)
    log.info("[launch] timeline of iteration %d: %s", it, png)


def _json_number(v):
    """NaN (a figure the trace could not give) -> None, so summary.json stays strict JSON."""
    if isinstance(v, dict):
        return {k: _json_number(x) for k, x in v.items()}
    return None if isinstance(v, float) and v != v else v
