"""Open the engine core a frontend talks to, in any deploy mode (docs/python_api.md).

* single mode in one process: an ``EngineCoreThread`` over this process's ``LLMEngine``;
* under ``mpiexec -n N python script.py``: every rank builds its part of the runtime; rank 0
  runs an ``EngineCoreThread`` over the runtime's ``RuntimeEngine`` and returns it; every other
  rank serves inside the call until rank 0 closes, then ends its process with status 0, so the
  script's code after it runs on rank 0 only;
* otherwise (a plain ``python script.py`` asking for several ranks, or any mode with
  ``own_process``): the ranks are started as an ``mpiexec`` child job (``spawn.SpawnedCore``),
  rank 0 of it serving the core over a local socket.

Every path gives a ``CoreClient``: inputs through ``submit``, each batch of ``CoreOutputs``
to the ``deliver`` callback (on a thread of the client's; hand them on, do no work), with the
core's own measurements (``engine.stats.CoreStats``) in ``CoreOutputs.stats``.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from megainfer.config import ResolvedJob
from megainfer.engine.core import CoreInput, CoreOutputs, EngineCore, EngineCoreThread

from .ranks import mpi_world, rank_job, single_engine, start_ranks

log = logging.getLogger("megainfer.core_client")


class CoreClient(Protocol):
    """``engine``: the engine when the core runs on a thread of this process (None: a child
    job's); ``ranks``: a child job's ranks (``RankInfo``; () when the core is here);
    ``busy_s``: how long a core here has been inside one round (0 for a child job's, whose
    rank 0 watches it)."""

    engine: Optional[object]
    ranks: tuple

    def submit(self, msg: CoreInput) -> None: ...

    @property
    def alive(self) -> bool: ...

    def busy_s(self) -> float: ...

    def shutdown(self, timeout: Optional[float] = None) -> None: ...


@dataclass(frozen=True)
class JobTree:
    """What every rank resolves its own ``ResolvedJob`` from (its GPU and threads depend on its
    rank): the config tree, the world size and whether ``deploy=auto`` asks the planner."""

    tree: dict
    world_size: int
    auto_plan: bool = False

    def resolve(self, rank: int, holds_cache: bool = True) -> ResolvedJob:
        """``holds_cache``: False for a frontend that only talks to the ranks
        (``resolve_job``)."""
        planner = None
        if self.auto_plan:
            from megainfer.perfmodel.plan.auto_plan import auto_plan as planner
        return rank_job(self.tree, self.world_size, rank, planner, holds_cache)


Deliver = Callable[[CoreOutputs], None]


def core_thread(engine, deliver: Deliver) -> EngineCoreThread:
    """The engine core over ``engine`` on a thread of this process, its measurements recorded
    and sent with its outputs."""
    return EngineCoreThread(EngineCore(engine), deliver)


def open_core(spec: JobTree, job: ResolvedJob, deliver: Deliver, tokenizer=None,
              own_process: bool = False) -> CoreClient:
    """``job``: this process's resolution of ``spec`` (rank 0's when it starts the ranks).
    ``own_process``: outside an ``mpiexec`` launch, run the core in a child job even in single
    mode (a server: the frontend's Python then never waits on the core's for the GIL)."""
    size, rank = mpi_world()
    if size == 1 and job.deploy.mode == "single" and not own_process:
        return core_thread(single_engine(job, tokenizer), deliver)
    if size > 1:
        engine = start_ranks(job)
        if engine is None:  # a rank other than 0: it served until rank 0 closed
            log.debug("rank %d: the job is over, exiting", rank)
            sys.exit(0)
        return core_thread(engine, deliver)
    from .spawn import SpawnedCore
    return SpawnedCore(spec, deliver)
