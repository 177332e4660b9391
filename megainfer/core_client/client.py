"""Open the engine core a frontend talks to, in any deploy mode.

* single mode in one process: an ``EngineCoreThread`` over this process's ``LLMEngine``;
* under ``mpiexec -n N python script.py``: every rank builds its part of the runtime; rank 0
  runs an ``EngineCoreThread`` over the runtime's ``RuntimeEngine``; every other rank serves
  inside the call until rank 0 closes, then exits with status 0;
* otherwise (a plain script asking for several ranks, or ``own_process``): an ``mpiexec``
  child job (``spawn.ChildJobClient``), rank 0 of it serving the core over a local socket.

Every path gives a ``CoreClient``: inputs through ``submit``, each batch of ``CoreOutputs`` to
the ``deliver`` callback (on a client thread: hand them on, do no work), the core's
``CoreStats`` in ``CoreOutputs.stats``. docs/python_api.md, "Two ways to run a script"."""
from __future__ import annotations

import logging
import sys
from typing import Callable, Iterator, Optional, Protocol

from megainfer.config import ResolvedJob
from megainfer.engine.resolve import JobTree
from megainfer.engine_core.core import EngineCore
from megainfer.engine_core.core import EngineCoreThread
from megainfer.engine_core.messages import CoreInput, CoreOutputs

from megainfer.engine_core.builder import (mpi_world, serve_rank0, single_engine,
                                           start_ranks)

from .request_stream import Intake
from .inproc import InprocClient
from .spawn import ChildJobClient
from .sync_client import QueuedOutputs, SyncClient

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


Deliver = Callable[[CoreOutputs], None]


def core_thread(engine, deliver: Deliver) -> EngineCoreThread:
    """The engine core over ``engine`` on a thread of this process, its measurements recorded
    and sent with its outputs."""
    return EngineCoreThread(EngineCore(engine), deliver)


def engine_here(job: ResolvedJob, tokenizer=None, own_process: bool = False):
    """The engine when it runs in this process: single mode's ``LLMEngine``, or rank 0's
    ``RuntimeEngine`` under ``mpiexec``; None when it must run in a child job (``own_process``, or several ranks asked for from a
    plain script). A rank other than 0 of an ``mpiexec`` launch serves inside this call until
    rank 0 closes, then ends its process with status 0."""
    size, rank = mpi_world()
    if size == 1 and job.deploy.mode == "single" and not own_process:
        return single_engine(job, tokenizer)
    if size > 1:
        engine = start_ranks(job)
        if engine is None:  # a rank other than 0: it served until rank 0 closed
            log.debug("rank %d: the job is over, exiting", rank)
            sys.exit(0)
        return engine
    return None


def open_core(spec: JobTree, job: ResolvedJob, deliver: Deliver, tokenizer=None,
              own_process: bool = False) -> CoreClient:
    """A streaming core whose outputs go to ``deliver`` (``AsyncLLM``). ``job``: this process's
    resolution of ``spec`` (rank 0's when it starts the ranks). ``own_process``: outside an
    ``mpiexec`` launch, run the core in a child job even in single mode (a server: the
    frontend's Python then never waits on the core's for the GIL)."""
    engine = engine_here(job, tokenizer, own_process)
    if engine is not None:
        return core_thread(engine, deliver)
    return ChildJobClient(spec, deliver)


def open_sync(spec: JobTree, job: ResolvedJob, tokenizer=None,
              own_process: bool = False) -> SyncClient:
    """``LLM``'s client. The engine here with nothing to watch it between calls (single
    mode): its core stepped on this thread; here as rank 0 of an ``mpiexec`` launch (its ranks
    must hear from it every idle interval, also while the script does something else): its
    core on a thread; both final-only (no per-token work). Else a child job's core."""
    engine = engine_here(job, tokenizer, own_process)
    if engine is not None and engine.idle_interval_s is None:
        return inproc_client(engine)
    outputs = QueuedOutputs()
    if engine is not None:
        core = EngineCoreThread(EngineCore(engine, stream=False), outputs.deliver)
        intake, final_only = Intake.of_engine(engine), True
    else:
        core, intake, final_only = ChildJobClient(spec, outputs.deliver), \
            Intake.for_job(job, tokenizer), False
    outputs.core = core
    return SyncClient(core, outputs.next_outputs, intake, final_only)


def launch_client(r) -> SyncClient:
    """Rank 0 of an ``mpiexec`` launch whose ranks are built already (``ranks.build_ranks``;
    ``megainfer-launch``'s offline job): its ``RuntimeEngine`` stepped on this thread, final
    outputs only. Closing it stops every rank."""
    from megainfer.runtime.runtime_engine import RuntimeEngine  # starts MPI: ranks only
    return inproc_client(RuntimeEngine(r))


def run_job(r, inputs) -> Optional[Iterator]:
    """Every rank of a job built already (``ranks.build_ranks`` or ``startup.build_rank``;
    tests and benchmarks): rank 0 gets the outputs of ``inputs`` as they finish, through its
    ``launch_client`` (the ranks stopped and this rank's connections closed once all are
    read); every other rank serves until then and gets None."""
    if r.role.rank != 0:
        serve_rank0(r)
        return None
    client = launch_client(r)

    def outputs():
        yield from client.generate_stream(inputs)
        client.close()
    return outputs()


def inproc_client(engine) -> SyncClient:
    """``LLM``'s client over an engine in this process, its core stepped on the caller's
    thread, final-only."""
    core = InprocClient(EngineCore(engine, stream=False))
    return SyncClient(core, core.next_outputs, Intake.of_engine(engine), final_only=True)
