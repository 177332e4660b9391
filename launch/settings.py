"""Composed Hydra config -> frozen, validated settings objects (no Hydra beyond this door).

Every group is checked key by key: an unknown key is a ``ConfigError`` naming it (Hydra's
struct mode already refuses ``group.key=value`` overrides of missing keys; this also catches
``+group.key=...`` and hand-written YAML).
"""
from __future__ import annotations

from dataclasses import dataclass
import logging
import os
from typing import Optional

from megainfer.config import (CacheConfig, CommConfig, ConfigError, DeployPlan, DeviceConfig,
                              EplbConfig, LoadConfig, ModelConfig, ReplanConfig, SchedulerConfig,
                              TraceConfig)
from megainfer.engine import SamplingParams, check_cache_fits
from megainfer.engine.errors import SamplingParamsError
from megainfer.engine.sizing import (check_kv_cache_dtype, derive_num_blocks,
                                     resolve_max_model_len)
from megainfer.models.loader import DTYPES

from .auto_plan import auto_plan
from .config_keys import field_names, take
from .deploy import plan_for_world
from .model_source import model_config_of

log = logging.getLogger("megainfer.launch")

GROUPS = ("model", "deploy", "scheduler", "cache", "sampling", "io", "workload", "comm", "trace",
          "eplb", "engine", "replan")


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


@dataclass(frozen=True)
class JobSettings:
    model: ModelConfig
    load: LoadConfig
    deploy: DeployPlan
    scheduler: SchedulerConfig
    cache: CacheConfig
    sampling: SamplingParams  # the job's defaults; requests get their own seeds from seed
    seed: int
    io: IOSettings
    workload: WorkloadSettings
    cpu_threads: int  # torch intra-op threads of this process
    comm: CommConfig = CommConfig()
    trace: TraceConfig = TraceConfig()
    eplb: EplbConfig = EplbConfig()
    device: DeviceConfig = DeviceConfig()
    replan: ReplanConfig = ReplanConfig()  # online re-planning (docs/replan.md)


def auto_cpu_threads(model: ModelConfig, local_ranks: int) -> int:
    """This process's share of the cores; one thread for a model too small to split
    (hidden_size < 512: per-op threading overhead exceeds the work, badly so on a busy host)."""
    if model.hidden_size < 512:
        return 1
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def _plain(cfg) -> dict:
    try:
        from omegaconf import OmegaConf
        if OmegaConf.is_config(cfg):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return dict(cfg)


def _model(d: dict, device: DeviceConfig) -> tuple[ModelConfig, LoadConfig]:
    d = take("model", d, {"path", "load_format", "dtype", "seed", "arch", "attention_backend"})
    cfg = model_config_of(d)
    path, fmt = d.get("path"), d.get("load_format", "auto")
    path = os.path.expanduser(str(path)) if path else path
    if fmt == "auto":
        fmt = "safetensors" if path else "dummy"
    dtype = d.get("dtype", "auto")
    dtype = device.default_dtype() if dtype in (None, "auto") else dtype
    device.check_model(cfg, dtype)  # before any weight is read
    load = LoadConfig(path=path, load_format=fmt, dtype=dtype, seed=int(d.get("seed", 0)))
    return cfg, load


def resolve_device(c: dict, local_rank: int, distributed: bool) -> DeviceConfig:
    """``deploy.device``, ``model.attention_backend``, ``engine.cuda_graphs`` -> DeviceConfig.
    ``auto`` is cuda when one is visible, except for the distributed modes (cpu unless
    ``deploy.device=cuda`` is named: each rank then takes GPU ``local_rank % visible``)."""
    e = take("engine", c.get("engine") or {}, {"cuda_graphs"})
    device = (c.get("deploy") or {}).get("device")
    if distributed and device in (None, "auto"):
        device = "cpu"
    return DeviceConfig.resolve(device,
                                (c.get("model") or {}).get("attention_backend"),
                                e.get("cuda_graphs", True), local_rank)


def resolve_deploy(d: dict, world_size: int) -> DeployPlan:
    """``deploy.*`` (checked key by key) -> a DeployPlan for ``world_size`` ranks
    (``launch/deploy.py``)."""
    d = take("deploy", d, field_names(DeployPlan) | {"cpu_threads", "device", "hardware"})
    d.pop("cpu_threads", None)
    d.pop("device", None)
    d.pop("hardware", None)  # the planner's profile (launch/auto_plan.py)
    return plan_for_world(d, world_size)


def _sampling(d: dict) -> tuple[SamplingParams, int]:
    d = take("sampling", d, field_names(SamplingParams))
    seed = d.pop("seed", 0)
    seed = 0 if seed is None else seed
    try:
        return SamplingParams(**d), seed
    except SamplingParamsError as e:
        raise ConfigError(f"sampling.{e}") from e


def _prefill_ranks(d: dict) -> int:
    """``deploy.prefill_replicas x prefill_tp`` when both are valid (DeployPlan names bad ones)."""
    p, tp = d.get("prefill_replicas") or 0, d.get("prefill_tp") or 1
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (p, tp))
    return p * tp if ok else 0


def settings_from_config(cfg, world_size: int = 1, local_ranks: int = 1,
                         local_rank: int = 0) -> JobSettings:
    """The composed config (DictConfig or dict) -> JobSettings, validated. ``local_ranks``:
    processes of this launch on this host (they share its cores); ``local_rank``: this
    process's index among them (on cuda it takes that GPU, modulo the visible ones)."""
    c = _plain(cfg)
    c.pop("hydra", None)
    take("config", c, set(GROUPS))
    take("deploy", c.get("deploy") or {}, field_names(DeployPlan) | {"cpu_threads", "device", "hardware"})
    # deploy=auto: the planner sizes the decode side over the ranks prefill ranks leave (docs/pd.md)
    planned, sched = auto_plan(c, world_size - _prefill_ranks(c.get("deploy") or {}))
    deploy = resolve_deploy(planned, world_size)
    device = resolve_device(c, local_rank, distributed=deploy.mode != "single")
    model, load = _model(c.get("model", {}), device)
    s = take("scheduler", sched, field_names(SchedulerConfig))  # the plan's batch limit applied
    s["max_model_len"] = resolve_max_model_len(model, s.get("max_model_len"))
    scheduler = SchedulerConfig(**s)
    k = take("cache", c.get("cache", {}), {"block_size", "num_blocks", "memory_gib",
                                            "enable_prefix_caching", "kv_cache_dtype",
                                            "host_kv_gib", "kv_store_dir", "kv_scale_granularity"})
    block_size = k.get("block_size", 16)
    num_blocks = k.get("num_blocks")
    if num_blocks is None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"cache.block_size={block_size!r}: must be a positive integer")
        kv_heads = max(1, model.num_kv_heads // deploy.attention_tp)
        fmt = CacheConfig(**{f: k[f] for f in ("kv_cache_dtype", "kv_scale_granularity")
                             if f in k})  # validated first
        num_blocks = derive_num_blocks(model, scheduler.max_model_len, scheduler.max_num_seqs,
                                       block_size, float(k.get("memory_gib", 4.0)),
                                       DTYPES[load.dtype], kv_heads, fmt.kv_cache_dtype,
                                       fmt.kv_scale_granularity)
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                        **{f: k[f] for f in ("enable_prefix_caching", "kv_cache_dtype",
                                             "host_kv_gib", "kv_store_dir",
                                             "kv_scale_granularity") if f in k})
    check_kv_cache_dtype(model, cache.kv_cache_dtype, device.attention_backend)
    check_cache_fits(cache, scheduler.max_model_len)
    sampling, seed = _sampling(c.get("sampling", {}))
    io = IOSettings(**take("io", c.get("io", {}), field_names(IOSettings)))
    if io.output:
        check_output_path(io.output)
    w = take("workload", c.get("workload", {}), field_names(WorkloadSettings))
    if "prompts" in w:
        w["prompts"] = tuple(w["prompts"] or ())
    workload = WorkloadSettings(**w)
    threads = c.get("deploy", {}).get("cpu_threads")
    if threads is None:
        threads = auto_cpu_threads(model, local_ranks)
    elif not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"deploy.cpu_threads={threads!r}: must be a positive integer or null")
    extra = {g: cls(**take(g, c.get(g) or {}, field_names(cls)))
             for g, cls in (("comm", CommConfig), ("trace", TraceConfig), ("eplb", EplbConfig),
                                          ("replan", ReplanConfig))}
    cores = os.cpu_count() or 1
    if extra["comm"].wait_mode == "spin" and local_ranks > cores:
        log.warning("comm.wait_mode=spin with %d ranks on %d cores: a spinning wait holds a core "
                    "another rank needs (orders of magnitude slower in perf/bench/bench_m2n.py), and "
                    "spinning ranks on shared cores have hung MPI in that benchmark "
                    "(docs/comm.md); use backoff (the default) or yield", local_ranks, cores)
    return JobSettings(model, load, deploy, scheduler, cache, sampling, seed, io, workload,
                       threads, device=device, **extra)

