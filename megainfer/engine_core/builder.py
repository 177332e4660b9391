"""Build an engine core's engine from a resolved job, in any deploy mode: single mode's
``LLMEngine`` in this process, or this MPI rank's part of the distributed runtime, whose rank 0
is the engine (``RuntimeEngine``) and whose other ranks serve it until it closes. The runtime
(whose import initialises MPI) is imported only by the functions that start ranks: a frontend
that talks to a child job never initialises MPI."""
from __future__ import annotations

import logging

import torch

from megainfer.config import ConfigError, ResolvedJob
from megainfer.engine import LLMEngine
from megainfer.engine.tokenizer import load_tokenizer
from megainfer.models.loader import build_model

from .launch_env import world_rank, world_size

log = logging.getLogger("megainfer.engine_core")


def mpi_world() -> tuple[int, int]:
    """(size, rank) of the MPI launch this process is part of; (1, 0) outside one."""
    return world_size(), world_rank()


def device_name(device) -> str:
    if device.device != "cuda":
        return "cpu"
    return f"cuda:{device.index} ({torch.cuda.get_device_name(device.index)})"


def single_engine(job: ResolvedJob, tokenizer=None):
    """Single mode: the whole model in this process and its ``LLMEngine``."""
    if job.replan.enabled:  # nothing to re-plan: the one process holds every part
        raise ConfigError("replan.enabled=true: re-planning moves ranks between attention and "
                          "expert roles; deploy.mode=single has one process (re-planning runs "
                          "in deploy.mode=disaggregated)")
    device = job.device
    if job.cpu_threads is not None:
        torch.set_num_threads(job.cpu_threads)
    if device.device == "cuda":
        torch.cuda.set_device(device.index)  # Triton launches on the current device
    model = build_model(job.model, job.load, device=device.torch_device)
    model.set_attention_backend(device.attention_backend)
    log.info("[attn dp0 tp0] %s on %s, %s weights, attention %s%s, %d cpu threads",
             job.model.family, device_name(device), job.load.dtype, device.attention_backend,
             ", CUDA graphs for decode" if device.cuda_graphs else "", torch.get_num_threads())
    return LLMEngine.from_model(
        model, job.scheduler, job.cache,
        tokenizer or load_tokenizer(job.load.path, job.model.eos_token_id), seed=job.seed,
        cuda_graphs=device.cuda_graphs)


def start_ranks(job: ResolvedJob, comm=None):
    """Collective over ``comm`` (default ``MPI.COMM_WORLD``; every rank calls it): build this
    rank's part of the job. Rank 0 returns its ``OnlineEngine`` (single mode, world 1: an
    ``LLMEngine``; else the runtime's ``RuntimeEngine``). Every other rank serves rank 0 until rank 0 closes
    its engine, then returns None."""
    if job.deploy.mode == "single":
        return single_engine(job)
    from megainfer.runtime.runtime_engine import RuntimeEngine  # starts MPI (module docstring)
    r = build_ranks(job, comm)
    if r.role.rank == 0:
        return RuntimeEngine(r)
    serve_rank0(r)
    return None


def build_ranks(job: ResolvedJob, comm=None):
    """Collective: this rank's ``Rank`` of a distributed job, its threads set
    (``startup.build_rank``: with ``trace.enabled`` on cpu the expert ranks' spans reach rank 0
    as the job runs, the engine core's live T_e / T_c). A job its feature cannot run
    (re-planning: ``replan.check_replan``) is refused by every rank alike before anything
    collective."""
    from mpi4py import MPI  # these two start MPI (module docstring)

    from megainfer.runtime.startup import build_rank
    if job.cpu_threads is not None:
        torch.set_num_threads(job.cpu_threads)
    return build_rank(job, MPI.COMM_WORLD if comm is None else comm)


def serve_rank0(r) -> None:
    """A rank other than 0: serve rank 0's engine until its last iteration says stop, then
    close this rank's connections (as rank 0's engine does when it closes: the same
    collectives on every rank)."""
    from megainfer.runtime.span_report import send_last_report
    from megainfer.runtime.startup import run_rank  # starts MPI (module docstring)
    try:
        run_rank(r)
        send_last_report(r)  # rank 0 receives up to it before it closes
    finally:
        r.close()
