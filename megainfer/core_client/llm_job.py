"""``LLM(...)``'s arguments -> the job it runs: the config tree through the launcher's
resolution (``megainfer.engine.resolve``), its world size (the ``mpiexec`` launch this process
is part of, else ``world_size``, else what the plan's counts need), and the ``JobTree`` every
rank resolves again for itself. A ``ConfigError`` names the Python argument the bad value came
from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from megainfer.config import ConfigError, ModelConfig, ResolvedJob
from megainfer.config.llm_args import llm_tree, named_error
from megainfer.engine.resolve import JobTree, deploy_world_size
from megainfer.engine_core.builder import mpi_world


@dataclass(frozen=True)
class LLMJob:
    """``spec``: what every rank resolves (None: the launcher's own single-mode job); ``job``:
    this process's resolution of it (rank 0's when this process starts the ranks)."""

    spec: Optional[JobTree]
    job: ResolvedJob


def resolve_llm_job(args: Mapping, model, deploy: Union[None, str, Mapping],
                    tensor_parallel_size: Optional[int], world_size: Optional[int],
                    overrides: Sequence[str], enforce_eager: bool = False,
                    engine_process: bool = False) -> LLMJob:
    """``args``: ``LLM``'s arguments by name (``llm_args.ARG_KEYS``; None: not given).
    ``engine_process``: single mode's core too runs in a child job. This process holds a KV
    cache only under ``mpiexec`` (it is rank 0) or as single mode's core; otherwise its job is
    resolved as a frontend's (``resolve_job(holds_cache=False)``: no CUDA context here)."""
    launch_size, rank = mpi_world()
    world = None if world_size is None else f"world_size={world_size!r}"
    origin: dict = {}
    try:
        if launch_size > 1 and world_size not in (None, launch_size):
            raise ConfigError(f"world size {world_size}: this process is one of an mpiexec "
                              f"launch of {launch_size} ranks; give world_size={launch_size} "
                              "or leave it out")
        if deploy is None and tensor_parallel_size in (None, 1) and world_size in (None, 1) \
                and launch_size == 1:
            deploy = "single"
        tree, origin = llm_tree(args, deploy, overrides)
        if enforce_eager:
            origin["engine.cuda_graphs"] = "enforce_eager=True"
        if isinstance(model, ModelConfig):
            tree.setdefault("model", {})["arch"] = model
        size = launch_size if launch_size > 1 else deploy_world_size(tree, world_size)
        spec = JobTree(tree, size)
        holds_cache = launch_size > 1 or (size == 1 and not engine_process)  # else a frontend
        job = spec.resolve(rank, holds_cache=holds_cache)
    except ConfigError as e:
        named = named_error(e, origin, world)
        if named is e:
            raise
        raise named from e
    return LLMJob(spec, job)
