"""Composed Hydra config -> frozen, validated settings objects (no Hydra beyond this door).

The job's groups go through the one resolution ``LLM`` uses too (``megainfer.engine.resolve``:
every key checked, an unknown one a ``ConfigError`` naming it and the closest known key); this
adds the groups only the offline job reads (sampling defaults, io, workload) and the launch-time
planner for ``deploy=auto`` over N > 1 ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
import logging
import os
from typing import Optional

from megainfer.config import ConfigError, ResolvedJob
from megainfer.config.keys import field_names, take
from megainfer.engine.resolve import GROUP_KEYS, resolve_job
from megainfer.engine import SamplingParams
from megainfer.engine.errors import SamplingParamsError

log = logging.getLogger("megainfer.launch")

JOB_GROUPS = ("sampling", "io", "workload")  # the offline job's own groups


class OutputFileError(ConfigError):
    """io.output cannot be created or written; raised before any work starts."""


def check_output_path(path: str) -> None:
    """Refuse an output that cannot be written, without creating anything: a directory, an
    existing file without write permission, a parent that is a file, or a missing directory
    whose nearest existing ancestor does not allow creating it."""
    key = f"io.output={path!r}"
    p = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(p):
        raise OutputFileError(f"{key}: is a directory (give a file path, e.g. {path.rstrip('/')}"
                              "/generations.jsonl)")
    if os.path.exists(p):
        if not os.access(p, os.W_OK):
            raise OutputFileError(f"{key}: no permission to write it")
        return
    d = os.path.dirname(p)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise OutputFileError(f"{key}: cannot create it: {d} is a file, not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise OutputFileError(f"{key}: cannot create it: no permission to write in {d}")


@dataclass(frozen=True)
class IOSettings:
    input: Optional[str] = None
    output: Optional[str] = None
    resume: bool = True
    progress: bool = True
    strict: bool = False  # a bad input line refuses the whole file (else: an error record)

    def __post_init__(self):
        for k in ("resume", "progress", "strict"):
            if not isinstance(getattr(self, k), bool):
                raise ConfigError(f"io.{k}={getattr(self, k)!r}: must be true or false")
        for k in ("input", "output"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ConfigError(f"io.{k}={v!r}: must be a file path or null")


@dataclass(frozen=True)
class WorkloadSettings:
    kind: str = "prompts"  # prompts | random
    prompts: tuple[str, ...] = ()
    num_prompts: int = 0
    input_len: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("prompts", "random"):
            raise ConfigError(f"workload.kind={self.kind!r}: must be 'prompts' or 'random'")
        if self.kind == "random" and (self.num_prompts < 1 or self.input_len < 1):
            raise ConfigError(f"workload.num_prompts={self.num_prompts}, workload.input_len="
                              f"{self.input_len}: a random workload needs both >= 1")


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


def _plain(cfg) -> dict:
    try:
        from omegaconf import OmegaConf
        if OmegaConf.is_config(cfg):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return dict(cfg)


def _sampling(d: dict) -> SamplingParams:
    """The job's default SamplingParams; ``sampling.seed`` is the job seed (ResolvedJob.seed)."""
    d = take("sampling", d, field_names(SamplingParams))
    d.pop("seed", None)
    try:
        return SamplingParams(**d)
    except SamplingParamsError as e:
        raise ConfigError(f"sampling.{e}") from e


def settings_from_config(cfg, world_size: int = 1, local_ranks: int = 1,
                         local_rank: int = 0, holds_cache: bool = True) -> JobSettings:
    """The composed config (DictConfig or dict) -> JobSettings, validated. ``local_ranks``:
    processes of this launch on this host (they share its cores); ``local_rank``: this
    process's index among them (on cuda it takes that GPU, modulo the visible ones);
    ``holds_cache=False``: a frontend's resolution (``resolve_job``: no CUDA context here)."""
    c = _plain(cfg)
    c.pop("hydra", None)
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
