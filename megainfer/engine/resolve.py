"""One config resolution for ``LLM`` and the launcher: a plain tree of ``group.key`` values ->
``ResolvedJob``, every check run once, before any weight is read (docs/architecture.md, "Module
map").

In order: every key checked against its group's schema (``GROUP_KEYS``); ``model.path`` made
local; the deploy plan (``deploy=auto`` over N > 1 ranks asks the performance model's planner,
``perfmodel/plan/auto_plan.py``, from here only) fitted to the world size; the device; model and weights; the scheduler; the KV cache
(format, block count from the memory budget, fit); the CPU threads; comm, trace, EPLB, re-plan.
It sits above ``megainfer.config`` because the cache's size needs the model's KV spec and
weight bytes (``sizing.py``, ``models/loader.py``). ``JobTree`` is what every door (``LLM``, the
launcher, the server) hands its ranks: the tree and the world size (``deploy_world_size``, from
``DeployPlan.world_size`` alone), each rank resolving its own job from it."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from megainfer.config import (CacheConfig, CommConfig, ConfigError, DeployPlan, DeviceConfig,
                              EplbConfig, LoadConfig, ModelConfig, PdConfig, ReplanConfig, ResolvedJob,
                              SchedulerConfig, SloConfig, TraceConfig)
from megainfer.config.base import require
from megainfer.config.deploy_fit import plan_for_world
from megainfer.config.hf_cache import checkpoint_dir
from megainfer.config.keys import field_names, take
from megainfer.config.model_source import model_config_of
from megainfer.models.kv_spec import kv_head_slice
from megainfer.models import ParallelContext
from megainfer.models.loader import weight_bytes
from megainfer.perfmodel.plan.auto_plan import auto_plan

from .sizing import check_cache_fits
from .sizing import check_kv_cache_dtype, derive_num_blocks, resolve_max_model_len

log = logging.getLogger("megainfer.engine")

# group -> the keys it takes (docs/config.md lists them with their meaning)
GROUP_KEYS: dict[str, set] = {
    "model": {"path", "revision", "load_format", "dtype", "seed", "arch", "attention_backend",
              "quantization", "quantization_group_size"},
    "deploy": field_names(DeployPlan) | {"cpu_threads", "device", "hardware"},
    "scheduler": field_names(SchedulerConfig),
    "cache": {"block_size", "num_blocks", "memory_gib", "gpu_memory_utilization",
              "enable_prefix_caching", "kv_cache_dtype", "host_kv_gib", "kv_store_dir",
              "kv_scale_granularity"},
    "engine": {"cuda_graphs"},
    "comm": field_names(CommConfig),
    "trace": field_names(TraceConfig),
    "eplb": field_names(EplbConfig),
    "replan": field_names(ReplanConfig),
    "slo": field_names(SloConfig),
    "pd": field_names(PdConfig),
}
_PLAIN_GROUPS = (("comm", CommConfig), ("trace", TraceConfig), ("eplb", EplbConfig),
                 ("replan", ReplanConfig), ("slo", SloConfig), ("pd", PdConfig))
_NOT_PLAN_KEYS = ("cpu_threads", "device", "hardware")  # deploy.* keys that are not DeployPlan's


@dataclass(frozen=True)
class JobTree:
    """What every rank resolves its own ``ResolvedJob`` from (its GPU and threads depend on its
    rank): the config tree and the world size. It crosses to a child job's ranks."""

    tree: dict
    world_size: int

    def resolve(self, rank: int, holds_cache: bool = True) -> ResolvedJob:
        """Rank ``rank``'s job (every rank of one host: ``local_rank`` picks its GPU and its
        share of the cores); ``holds_cache``: False for a frontend (``resolve_job``)."""
        return resolve_job(self.tree, self.world_size, local_ranks=self.world_size,
                           local_rank=rank, holds_cache=holds_cache)


def deploy_world_size(tree: Mapping, world_size: Optional[int] = None) -> int:
    """``world_size``, else the ranks the deploy plan needs (``DeployPlan.world_size``, the one
    rule) when the tree gives every count, else 1. Bad counts raise ``DeployPlan``'s
    ``ConfigError`` naming the key."""
    if world_size is not None:
        return world_size
    d = tree.get("deploy") or {}
    counts = ("attention_replicas",) if d.get("mode") == "colocated" else \
        ("attention_replicas", "attention_tp", "expert_ranks")
    if d.get("mode") not in ("colocated", "disaggregated") or \
            not all(isinstance(d.get(k), int) for k in counts):
        return 1
    return DeployPlan(**{k: d[k] for k in field_names(DeployPlan) if d.get(k) is not None}
                      ).world_size


def resolve_job(tree: Mapping, world_size: int = 1, local_ranks: int = 1, local_rank: int = 0,
                other_groups: tuple = (), holds_cache: bool = True) -> ResolvedJob:
    """``tree`` ({group: {key: value}}) -> the job's ResolvedJob. ``local_ranks``: processes of
    this job on this host (they share its cores); ``local_rank``: this process's index among
    them (on cuda it takes that GPU, modulo the visible ones). ``other_groups``: top-level
    groups the caller reads itself (the launcher's sampling, io, workload); ``sampling.seed`` is
    the job seed here. ``holds_cache=False``: this process only fronts the ranks (it builds no
    KV pool): ``cache.gpu_memory_utilization`` is then applied to the GPU's total memory, not
    measured free memory, since measuring opens a CUDA context here that would hold GPU memory
    for the frontend's life (and keep the ranks off a GPU in exclusive-process mode); the
    ranks size their own pools."""
    c = {g: dict(v) if isinstance(v, Mapping) else v for g, v in tree.items()}
    take("config", c, set(GROUP_KEYS) | {"sampling"} | set(other_groups))
    for g, known in GROUP_KEYS.items():
        c[g] = take(g, c.get(g) or {}, known)
    c["model"] = local_model(c["model"])
    d = c["deploy"]
    planned, sched, pd = auto_plan(c, world_size)  # deploy=auto: the plan; else as given
    # pd.offload null (unset): the planner's when it plans a server, else PdConfig's false
    c["pd"] = {k: v for k, v in pd.items() if not (k == "offload" and v is None)}
    deploy = plan_for_world({k: v for k, v in planned.items() if k not in _NOT_PLAN_KEYS},
                            world_size)
    device = resolve_device(c, local_rank, distributed=deploy.mode != "single")
    model, load = _model(c["model"], device)
    s = take("scheduler", sched, field_names(SchedulerConfig))  # the plan's batch limit applied
    s["max_model_len"] = resolve_max_model_len(model, s.get("max_model_len"))
    scheduler = SchedulerConfig(**s)
    cache = _cache(c["cache"], model, load, deploy, scheduler, device, holds_cache)
    seed = (c.get("sampling") or {}).get("seed")
    return ResolvedJob(model, load, scheduler, cache, deploy, seed=0 if seed is None else seed,
                     device=device, cpu_threads=_threads(d.get("cpu_threads"), model, local_ranks),
                     **{g: cls(**c[g]) for g, cls in _PLAIN_GROUPS})


def local_model(m: dict) -> dict:
    """The ``model`` group with ``path`` a local directory (a Hugging Face model id resolved from
    the local cache at ``revision``) and ``revision`` spent."""
    m = dict(m)
    revision = m.pop("revision", None)
    if m.get("path"):
        m["path"] = checkpoint_dir(m["path"], revision)
    elif revision is not None:
        raise ConfigError(f"model.revision={revision!r}: a revision needs model.path (a Hugging "
                          "Face model id)")
    return m


def resolve_device(c: Mapping, local_rank: int, distributed: bool) -> DeviceConfig:
    """``deploy.device``, ``model.attention_backend``, ``engine.cuda_graphs`` -> DeviceConfig.
    ``auto`` is cuda when one is visible, except for the distributed modes (cpu unless
    ``deploy.device=cuda`` is named: each rank then takes GPU ``local_rank % visible``)."""
    device = (c.get("deploy") or {}).get("device")
    if distributed and device in (None, "auto"):
        device = "cpu"
    return DeviceConfig.resolve(device, (c.get("model") or {}).get("attention_backend"),
                                (c.get("engine") or {}).get("cuda_graphs", True), local_rank)


def _model(d: dict, device: DeviceConfig) -> tuple[ModelConfig, LoadConfig]:
    cfg = model_config_of(d)
    path, fmt = d.get("path"), d.get("load_format", "auto")
    if fmt == "auto":
        fmt = "safetensors" if path else "dummy"
    dtype = d.get("dtype", "auto")
    dtype = device.default_dtype() if dtype in (None, "auto") else dtype
    load = LoadConfig(path=path, load_format=fmt, dtype=dtype, seed=int(d.get("seed") or 0),
                      quantization=d.get("quantization"),
                      quantization_group_size=d.get("quantization_group_size", 64))
    device.check_model(cfg, dtype, load.quantization)  # before any weight is read
    return cfg, load


def _cache(k: dict, model: ModelConfig, load: LoadConfig, deploy: DeployPlan,
           scheduler: SchedulerConfig, device: DeviceConfig, holds_cache: bool = True
           ) -> CacheConfig:
    """``cache.*`` -> CacheConfig: its format checked against the model and the attention
    backend, ``num_blocks=null`` derived from the memory budget, the pool's fit checked."""
    require(isinstance(k.get("block_size", 1), int) and not isinstance(k.get("block_size"), bool),
             "cache.block_size", k.get("block_size"), "must be a positive integer")
    fields = {f: k[f] for f in ("block_size", "enable_prefix_caching", "kv_cache_dtype",
                                "host_kv_gib", "kv_store_dir", "kv_scale_granularity") if f in k}
    fmt = CacheConfig(**fields)  # every field but the block count validated first
    check_kv_cache_dtype(model, fmt.kv_cache_dtype, device.attention_backend)
    num_blocks = k.get("num_blocks")
    if num_blocks is None:
        memory_gib = kv_memory_gib(k, model, load, deploy, device, holds_cache)
        num_blocks = derive_num_blocks(model, scheduler.max_model_len, scheduler.max_num_seqs,
                                       fmt.block_size, memory_gib, load.torch_dtype,
                                       kv_head_slice(model.num_kv_heads,
                                                     deploy.attention_tp, 0)[1],
                                       fmt.kv_cache_dtype, fmt.kv_scale_granularity)
    cache = CacheConfig(num_blocks=num_blocks, **fields)
    check_cache_fits(cache, scheduler.max_model_len)
    return cache


def kv_memory_gib(k: Mapping, model: ModelConfig, load: LoadConfig, deploy: DeployPlan,
                  device: DeviceConfig, holds_cache: bool = True) -> float:
    """The KV pool's budget: ``cache.memory_gib``; on cuda with ``cache.gpu_memory_utilization``
    that share of the GPU's free memory less this rank's weights (counted, not loaded); of its
    total memory where this process holds no cache (``holds_cache=False``: no CUDA context is
    opened for it)."""
    util = k.get("gpu_memory_utilization")
    memory_gib = k.get("memory_gib", 4.0)
    require(isinstance(memory_gib, (int, float)) and not isinstance(memory_gib, bool)
             and memory_gib > 0, "cache.memory_gib", memory_gib, "must be a number > 0")
    if util is None:
        return float(memory_gib)
    require(isinstance(util, (int, float)) and not isinstance(util, bool) and 0 < util <= 1,
             "cache.gpu_memory_utilization", util, "must be a fraction in (0, 1]")
    if device.device != "cuda":
        log.info("cache.gpu_memory_utilization=%s applies on cuda; on cpu the KV pool is "
                 "cache.memory_gib=%s GiB", util, memory_gib)
        return float(memory_gib)
    if holds_cache:
        free, _ = torch.cuda.mem_get_info(device.index)  # opens this process's CUDA context
    else:  # a frontend: read without a context (the ranks measure their own free memory)
        free = torch.cuda.get_device_properties(device.index).total_memory
    role = "attention" if deploy.mode == "disaggregated" else "full"
    weights = weight_bytes(model, load.torch_dtype, ParallelContext(0, deploy.attention_tp), role,
                           load)  # in model.quantization's format
    return kv_budget_gib(util, free, weights, device.index, "free" if holds_cache else "in all")


def kv_budget_gib(util: float, free_bytes: int, weight_bytes: int, index: int = 0,
                  what: str = "free") -> float:
    """``util`` of ``free_bytes`` less ``weight_bytes``, in GiB; none left is a ConfigError."""
    budget = util * free_bytes - weight_bytes
    if budget <= 0:
        raise ConfigError(f"cache.gpu_memory_utilization={util}: {util:.0%} of the "
                          f"{free_bytes / 2**30:.2f} GiB {what} on cuda:{index} leaves no room for "
                          f"the KV cache after {weight_bytes / 2**30:.2f} GiB of weights; raise "
                          "it, or give cache.num_blocks")
    return budget / 2**30


def auto_cpu_threads(model: ModelConfig, local_ranks: int) -> int:
    """This process's share of the cores; one thread for a model too small to split
    (hidden_size < 512: per-op threading overhead exceeds the work, badly so on a busy host)."""
    if model.hidden_size < 512:
        return 1
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def _threads(threads, model: ModelConfig, local_ranks: int) -> int:
    if threads is None:
        return auto_cpu_threads(model, local_ranks)
    require(isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1,
             "deploy.cpu_threads", threads, "must be a positive integer or null")
    return threads
