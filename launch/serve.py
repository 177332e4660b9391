"""``megainfer-serve``: the Hydra front door of the HTTP server.

The launcher's config tree (``conf/config.yaml``) plus the ``serve`` group
(``conf/serve/default.yaml`` -> ``megainfer.config.ServeConfig``); everything but ``serve.*``
resolves through ``settings_from_config`` as for ``megainfer-launch`` (``megainfer/engine/job_doors.py``). Two ways to run:
* ``megainfer-serve deploy=...`` (``serve.engine_process=true``, the default): this process is
  the HTTP frontend; the engine core runs in a child job of ``serve.world_size`` ranks, rank 0
  talking to it over a local socket. A dead rank: /health 503, streams end, exit 1 naming it.
* ``mpiexec -n N megainfer-serve deploy=...``: rank 0 serves its ``RuntimeEngine`` with the
  frontend on a thread beside its core; every other rank serves rank 0 until its closing
  iteration, then exits 0; a failure after start-up on any rank aborts the whole job.
docs/serve.md, "Where things run"."""
from __future__ import annotations

import logging
import os
import signal
import sys

import hydra
from omegaconf import DictConfig

from megainfer.config import ConfigError, ServeConfig
from megainfer.engine import RequestError
from megainfer.engine.failures import EngineDeadError
from megainfer.engine.job_doors import serve_tree, settings_from_config
from megainfer.engine.resolve import JobTree, deploy_world_size

from megainfer.engine_core.launch_env import local_rank, local_ranks, world_rank, world_size
from megainfer.engine_core.messages import gather_roster, roster_text

log = logging.getLogger("megainfer.serve")


def serve_settings(cfg):
    """The composed config -> (JobSettings, ServeConfig), validated (identically on every
    rank: ``deploy=auto`` plans from the same inputs)."""
    c, serve = serve_tree(cfg)
    return settings_from_config(c, world_size(), local_ranks(), local_rank()), serve


def _abort_job(line: str, code: int) -> None:
    """Print ``line`` and end every rank of the job (a rank alone cannot leave it)."""
    print(line, file=sys.stderr, flush=True)
    from mpi4py import MPI
    from megainfer.runtime.startup import abort_job
    abort_job(MPI.COMM_WORLD, code)


def _ranks_line(ranks, extra: str = "") -> str:
    """``RankInfo``s -> the ``[serve] ranks:`` line (tests and benches read it back with
    ``messages.parse_roster``)."""
    return "[serve] ranks: " + roster_text(ranks) + extra


def _log_ranks(s) -> None:
    """Rank 0 prints every rank's role and pid (a process manager's "PID n died" names a pid)."""
    from mpi4py import MPI

    from megainfer.runtime.roles import assign_role
    comm = MPI.COMM_WORLD
    label = assign_role(s.deploy, comm.Get_rank(), comm.Get_size()).label
    ranks = gather_roster(comm, label)
    if ranks:
        print(_ranks_line(ranks), flush=True)


def _with_planner(client, job, cfg):
    """``replan.policy=planner``: the live planner plugs into the served engine
    (``ServedEngine.planner``); ``cfg``: the composed config (``deploy.hardware``)."""
    if job.replan.enabled and job.replan.policy == "planner":
        from megainfer.serve.planner_loop import ServedPlanner
        client.planner = ServedPlanner.for_job(job, cfg.deploy.get("hardware"), client.metrics)
    return client


def run_spawned(cfg, c: dict, serve: ServeConfig) -> int:
    """A plain process: the frontend here, the engine core in a child job (every mode);
    ``c``, ``serve``: ``serve_tree(cfg)``."""
    from megainfer.serve.served_engine import ServedEngine
    from megainfer.serve.metrics import iteration_role
    from megainfer.serve.server import metrics_label, serve_client, served_name
    world = deploy_world_size(c, serve.world_size)
    s = settings_from_config(c, world, world, 0, holds_cache=False)  # rank 0's settings, every
    # check up front; the KV pool is the child job's (no CUDA context in the frontend)
    spec = JobTree(c, world)
    name = served_name(serve, cfg.model.get("path"), s.model.family)
    client = _with_planner(ServedEngine.spawn(spec, s, name, serve, iteration_role(s),
                                              metrics_label(serve, name, cfg.model.get("path"))),
                           s, cfg)
    print(_ranks_line(client.llm.ranks, f"; frontend pid {os.getpid()}"), flush=True)
    log.info("[serve] the frontend serves %s over a child job of %d ranks", s.deploy.mode, world)
    return serve_client(client, serve, s.load.path)


def _can_spawn(c: dict, serve: ServeConfig) -> bool:
    """An ``mpiexec`` to start the child job with; without one, single mode falls back to its
    core on a thread here (a warning), and a distributed mode fails saying what is missing."""
    from megainfer.core_client.mpiexec_job import find_mpiexec
    from megainfer.engine.failures import CoreStartError
    try:
        find_mpiexec()
    except CoreStartError as e:
        if deploy_world_size(c, serve.world_size) > 1:
            raise
        log.warning("[serve] %s; single mode's engine core runs on a thread of this process", e)
        return False
    return True


def run_server(cfg) -> int:
    from megainfer.engine_core.builder import start_ranks
    from megainfer.serve.served_engine import ServedEngine
    from megainfer.serve.metrics import iteration_role
    from megainfer.serve.server import metrics_label, serve_client, served_name
    distributed, rank = world_size() > 1, world_rank()
    if not distributed:
        c, serve = serve_tree(cfg)
        if serve.engine_process and _can_spawn(c, serve):
            return run_spawned(cfg, c, serve)
    s, serve = serve_settings(cfg)  # a ConfigError here is every rank's alike: exit 2
    if distributed and serve.world_size not in (None, world_size()):
        raise ConfigError(f"serve.world_size={serve.world_size}: this is an mpiexec launch of "
                          f"{world_size()} ranks; leave it null or give {world_size()}")
    if distributed and rank != 0:
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 drains, then stops this rank
            signal.signal(sig, signal.SIG_IGN)
    try:
        if distributed:
            _log_ranks(s)
        engine = start_ranks(s)
        if engine is None:  # a rank other than 0: it served until rank 0 closed
            return 0
        if distributed:
            log.info("[serve] rank 0 serves %s over %d ranks", s.deploy.mode, world_size())
        name = served_name(serve, cfg.model.get("path"), s.model.family)
        client = _with_planner(ServedEngine.beside(
            engine, name, serve, iteration_role(s), engine.hang_after_s(float(s.comm.timeout_s)),
            metrics_label(serve, name, cfg.model.get("path"))), s, cfg)
        code = serve_client(client, serve, s.load.path)
    except (ConfigError, RequestError):
        if not distributed:
            raise
        code, why = 2, sys.exc_info()[1]
    except Exception as e:  # noqa: BLE001 - any failure on any rank ends the whole job
        if not distributed:
            raise
        code, why = 1, e
    else:
        why = None
    if distributed and code:
        _abort_job(f"[serve] rank {rank} error: "
                   f"{'engine core died' if why is None else f'{type(why).__name__}: {why}'}; "
                   "aborting the job", code)
    return code


@hydra.main(config_path="pkg://megainfer.conf", config_name="serve", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    try:
        code = run_server(cfg)
        if not code and world_size() > 1:
            from megainfer.runtime.startup import finish_job
            code = finish_job(f"[serve] rank {world_rank()}")
    except (ConfigError, RequestError) as e:
        if world_rank() == 0:
            print(f"[serve] error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 2
    except EngineDeadError as e:  # the child job of a plain process did not start
        print(f"[serve] error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    if code:
        sys.exit(code)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
