"""Each door's inputs -> the one resolution (``resolve.py``) -> the job it runs: ``LLM``'s
arguments (``resolve_llm_job``), the launcher's tree (``settings_from_config``: the resolved job
and the offline job's own groups, sampling defaults, io and workload) and the server's tree
(``serve_tree``: the ``serve`` group split off, the offline groups dropped). A tree comes as
any nested mapping (Hydra's ``DictConfig`` is one; nothing here imports Hydra).
docs/architecture.md, "Module map"."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from megainfer.config import ConfigError, ModelConfig, ResolvedJob, ServeConfig
from megainfer.config.keys import field_names, take
from megainfer.config.llm_args import llm_tree, named_error
from megainfer.config.offline_job import IOSettings, WorkloadSettings, check_output_path

from .errors import SamplingParamsError
from .resolve import GROUP_KEYS, JobTree, deploy_world_size, resolve_job
from .sampling_params import SamplingParams

log = logging.getLogger("megainfer.engine")

JOB_GROUPS = ("sampling", "io", "workload")  # the offline job's own groups


def plain_tree(cfg: Mapping) -> dict:
    """A nested mapping (values read, so interpolations resolved) -> plain dicts and lists;
    Hydra's own ``hydra`` group dropped."""
    def plain(v):
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, Sequence) and not isinstance(v, (str, bytes)):
            return [plain(x) for x in v]
        return v
    return {g: plain(v) for g, v in cfg.items() if g != "hydra"}


@dataclass(frozen=True, kw_only=True)
class JobSettings(ResolvedJob):
    """The resolved job (``ResolvedJob``) and the offline job's own groups."""

    sampling: SamplingParams = SamplingParams()  # the job's defaults; request seeds from seed
    io: IOSettings = IOSettings()
    workload: WorkloadSettings = WorkloadSettings()


def known_keys() -> dict[str, set]:
    """Every group the launcher reads -> its keys (``model.arch`` -> ModelConfig's fields)."""
    return {**GROUP_KEYS, "sampling": field_names(SamplingParams),
            "io": field_names(IOSettings), "workload": field_names(WorkloadSettings)}


def _sampling(d: dict) -> SamplingParams:
    """The job's default SamplingParams; ``sampling.seed`` is the job seed (ResolvedJob.seed)."""
    d = take("sampling", d, field_names(SamplingParams))
    d.pop("seed", None)
    try:
        return SamplingParams(**d)
    except SamplingParamsError as e:
        raise ConfigError(f"sampling.{e}") from e


def settings_from_config(cfg: Mapping, world_size: int = 1, local_ranks: int = 1,
                         local_rank: int = 0, holds_cache: bool = True) -> JobSettings:
    """The launcher's tree -> JobSettings, validated. ``local_ranks``: processes of this launch
    on this host (they share its cores); ``local_rank``: this process's index among them (on
    cuda it takes that GPU, modulo the visible ones); ``holds_cache=False``: a frontend's
    resolution (``resolve_job``: no CUDA context here)."""
    c = plain_tree(cfg)
    # deploy=auto: the planner splits the ranks (docs/perfmodel.md, "The planner at launch")
    job = resolve_job(c, world_size, local_ranks, local_rank, other_groups=JOB_GROUPS,
                      holds_cache=holds_cache)
    sampling = _sampling(c.get("sampling", {}))
    io = IOSettings(**take("io", c.get("io", {}), field_names(IOSettings)))
    if io.output:
        check_output_path(io.output)
    w = take("workload", c.get("workload", {}), field_names(WorkloadSettings))
    if "prompts" in w:
        w["prompts"] = tuple(w["prompts"] or ())
    workload = WorkloadSettings(**w)
    cores = os.cpu_count() or 1
    if job.comm.wait_mode == "spin" and local_ranks > cores:
        log.warning("comm.wait_mode=spin with %d ranks on %d cores: a spinning wait holds a core "
                    "another rank needs (orders of magnitude slower in perf/bench/bench_m2n.py), and "
                    "spinning ranks on shared cores have hung MPI in that benchmark "
                    "(docs/comm.md); use backoff (the default) or yield", local_ranks, cores)
    return JobSettings(**{f: getattr(job, f) for f in field_names(ResolvedJob)},
                       sampling=sampling, io=io, workload=workload)


def serve_tree(cfg: Mapping) -> tuple[dict, ServeConfig]:
    """The server's tree -> (the tree every rank and the frontend resolve, the serve group).
    The offline job's groups are dropped (each request carries its own sampling; ``deploy=auto``
    must not plan for the built-in prompts) but ``sampling.seed``, the seed of requests without
    their own, which a child job's ranks then get too."""
    c = plain_tree(cfg)
    serve = ServeConfig(**take("serve", c.pop("serve", None) or {}, field_names(ServeConfig)))
    seed = (c.get("sampling") or {}).get("seed")
    c = {g: v for g, v in c.items() if g not in JOB_GROUPS}
    if seed is not None:
        c["sampling"] = {"seed": seed}
    return c, serve


@dataclass(frozen=True)
class LLMJob:
    """``spec``: what every rank resolves (None: the launcher's own single-mode job); ``job``:
    this process's resolution of it (rank 0's when this process starts the ranks)."""

    spec: Optional[JobTree]
    job: ResolvedJob


def resolve_llm_job(args: Mapping, model, deploy: Union[None, str, Mapping],
                    tensor_parallel_size: Optional[int], world_size: Optional[int],
                    overrides: Sequence[str], enforce_eager: bool = False,
                    engine_process: bool = False, launch: tuple[int, int] = (1, 0)) -> LLMJob:
    """``LLM``'s arguments -> its job. ``args``: by name (``llm_args.ARG_KEYS``; None: not
    given). ``engine_process``: single mode's core too runs in a child job. ``launch``: (size,
    rank) of the ``mpiexec`` launch this process is part of ((1, 0): none). This process holds
    a KV cache only under ``mpiexec`` (it is rank 0) or as single mode's core; otherwise its job
    is resolved as a frontend's (``resolve_job(holds_cache=False)``: no CUDA context here). A
    ``ConfigError`` names the Python argument the bad value came from."""
    launch_size, rank = launch
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
