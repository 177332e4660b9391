"""How a job runs: loading, device, cache, scheduler, deploy plan, EPLB, comm, traces."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .base import (ATTENTION_BACKENDS, DEVICES, DTYPE_NAMES, ConfigError, check_weight_format,
                   require, torch_dtype_of)
from .model import ModelConfig

# the cache's storage formats (auto: the model dtype; docs/kv_cache.md, kernels/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
KV_SCALE_GRANULARITIES = ("tensor", "token_head")  # cache.kv_scale_granularity (docs/kv_cache.md)
DEFAULT_KV_SCALE_GRANULARITY = "token_head"  # CacheConfig's and LLM(...)'s default


@dataclass(frozen=True)
class LoadConfig:
    """Where weights come from. ``load_format='dummy'`` draws seeded random weights."""

    path: Optional[str] = None  # an HF checkpoint directory (safetensors; launcher and LLM: or an org/name model id in the local HF cache); null: dummy weights
    load_format: str = "safetensors"  # safetensors | dummy (launcher: auto, safetensors with a path)
    dtype: str = "float32"  # float32 | bfloat16 | float16 (auto: bfloat16 on cuda, float32 on cpu)
    seed: int = 0  # seed of the dummy weights
    # weight format of linear and expert weights (lm_head, embeddings, norms, routers stay in
    # model.dtype): null keeps the checkpoint's own (an FP8 checkpoint stays FP8) | fp8 (e4m3,
    # 128x128 block scales, per-token-group activations) | int8 (weight-only, per output
    # channel) | int4 (weight-only, per group of quantization_group_size inputs) | fp8_dequant
    # (an FP8 checkpoint dequantised on load into model.dtype); docs/checkpoints.md
    quantization: Optional[str] = None
    quantization_group_size: int = 64  # int4: input columns per scale (32, 64, 128 or 256)

    def __post_init__(self):
        require(self.load_format in ("safetensors", "dummy"), "model.load_format",
                 self.load_format, "must be 'safetensors' or 'dummy'")
        require(self.dtype in DTYPE_NAMES, "model.dtype", self.dtype,
                 "must be float32, bfloat16 or float16")
        check_weight_format(self.quantization, self.quantization_group_size)
        if self.load_format == "safetensors":
            require(self.path is not None and os.path.isdir(self.path), "model.path", self.path,
                     "must be an existing checkpoint directory (or use load_format=dummy)")

    @property
    def torch_dtype(self):
        """``dtype`` as the torch dtype the weights (and a full-precision KV cache) are held in."""
        return torch_dtype_of(self.dtype)


@dataclass(frozen=True)
class DeviceConfig:
    """Where a rank computes and how (``deploy.device``, ``model.attention_backend``,
    ``engine.cuda_graphs``), resolved: no ``auto`` here (``DeviceConfig.resolve`` picks).

    ``index``: the CUDA device of this process (from its node-local rank); ``cuda_graphs``
    applies to decode steps of single mode with the Triton backend on cuda."""

    device: str = "cpu"
    attention_backend: str = "torch"
    cuda_graphs: bool = False
    index: int = 0

    def __post_init__(self):
        require(self.device in DEVICES, "deploy.device", self.device,
                 f"must be one of {', '.join(DEVICES)}")
        require(self.attention_backend in ATTENTION_BACKENDS, "model.attention_backend",
                 self.attention_backend, f"must be one of {', '.join(ATTENTION_BACKENDS)}")
        require(isinstance(self.cuda_graphs, bool), "engine.cuda_graphs", self.cuda_graphs,
                 "must be true or false")
        if self.device == "cuda":
            import torch
            require(torch.cuda.is_available(), "deploy.device", self.device,
                     "no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES and "
                     "the driver); use deploy.device=cpu")
            n = torch.cuda.device_count()
            require(0 <= self.index < n, "deploy.device index", self.index,
                     f"{n} CUDA device(s) visible")
        elif self.attention_backend == "triton":
            require(os.environ.get("TRITON_INTERPRET") == "1", "model.attention_backend",
                     self.attention_backend, "Triton kernels on cpu run only under the interpreter "
                     "(TRITON_INTERPRET=1, slow: for tests); use attention_backend=torch on cpu")

    @property
    def torch_device(self):
        import torch
        return torch.device("cuda", self.index) if self.device == "cuda" else torch.device("cpu")

    @classmethod
    def resolve(cls, device: Optional[str] = None, attention_backend: Optional[str] = None,
                cuda_graphs: bool = True, local_rank: int = 0) -> "DeviceConfig":
        """``None`` or ``auto`` picks: cuda when visible, else cpu; Triton attention on cuda,
        torch on cpu. On cuda this process takes GPU ``local_rank % visible GPUs`` (its
        node-local rank; ``CUDA_VISIBLE_DEVICES`` is respected by CUDA itself)."""
        import torch
        require(isinstance(cuda_graphs, bool), "engine.cuda_graphs", cuda_graphs,
                 "must be true or false")
        if device in (None, "auto"):
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if attention_backend in (None, "auto"):
            attention_backend = "triton" if device == "cuda" else "torch"
        index = local_rank % max(1, torch.cuda.device_count()) if device == "cuda" else 0
        return cls(device, attention_backend, bool(cuda_graphs) and device == "cuda", index)

    def default_dtype(self) -> str:
        """bfloat16 on cuda, float32 on cpu (``model.dtype=auto``)."""
        return "bfloat16" if self.device == "cuda" else "float32"

    def check_model(self, model: "ModelConfig", dtype: str,
                    quantization: Optional[str] = None) -> None:
        """Refuse, before any weight is loaded, what the chosen kernels cannot take."""
        require(dtype in DTYPE_NAMES, "model.dtype", dtype, f"must be one of {', '.join(DTYPE_NAMES)}")
        require(not (quantization == "int4" and self.device != "cpu"), "model.quantization",
                 quantization, f"int4 weights are kept in torch's CPU int4 layout and run on cpu "
                 f"only, not deploy.device={self.device}; use model.quantization=int8 or fp8 "
                 "there, or deploy.device=cpu")
        if self.attention_backend == "triton" and not model.is_mla:  # MLA: its own backend
            from megainfer.kernels.attention_limits import attention_limits_error
            why = attention_limits_error(model.head_dim, model.num_heads, model.num_kv_heads, dtype)
            require(why is None, "model.attention_backend", self.attention_backend,
                     f"{why}; use attention_backend=torch")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens per layer, stored in
    ``kv_cache_dtype`` (``auto``: the model dtype); ``enable_prefix_caching`` reuses full blocks
    of a prompt prefix already computed (docs/engine.md)."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int = 512  # KV blocks per layer
    enable_prefix_caching: bool = True  # reuse full KV blocks of a prompt prefix already computed
    kv_cache_dtype: str = "auto"  # auto | fp8_e4m3 | fp8_e5m2 | fp4_e2m1 (docs/kv_cache.md)
    host_kv_gib: float = 0.0  # the prefix cache's second tier (0: off; docs/kv_cache.md)
    kv_store_dir: Optional[str] = None  # cpu: the second tier's files (None: a temp dir)
    kv_scale_granularity: str = DEFAULT_KV_SCALE_GRANULARITY  # quantised caches: tensor | token_head

    def __post_init__(self):
        require(self.block_size > 0, "cache.block_size", self.block_size, "must be > 0")
        require(self.num_blocks > 0, "cache.num_blocks", self.num_blocks, "must be > 0")
        require(isinstance(self.enable_prefix_caching, bool), "cache.enable_prefix_caching",
                 self.enable_prefix_caching, "must be true or false")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "cache.kv_cache_dtype",
                 self.kv_cache_dtype, f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        require(isinstance(self.host_kv_gib, (int, float)) and not isinstance(
            self.host_kv_gib, bool) and self.host_kv_gib >= 0, "cache.host_kv_gib",
            self.host_kv_gib, "must be a number >= 0 (0: no second tier)")
        require(self.kv_store_dir is None or (isinstance(self.kv_store_dir, str)
                                               and self.kv_store_dir != ""),
                 "cache.kv_store_dir", self.kv_store_dir, "must be null or a directory path")
        require(self.kv_scale_granularity in KV_SCALE_GRANULARITIES, "cache.kv_scale_granularity",
                 self.kv_scale_granularity, f"must be one of {', '.join(KV_SCALE_GRANULARITIES)}")


ROUTINGS = ("round_robin", "cache_aware")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget per step (vLLM v1 style): decode tokens and prefill chunks share it."""

    max_num_seqs: int = 64  # sequences running at once per attention replica
    max_num_batched_tokens: int = 512  # token budget per step: decodes plus prefill chunks
    max_model_len: int = 2048  # prompt plus output tokens per sequence
    enable_chunked_prefill: bool = True  # split long prompts into chunks that fit the token budget
    routing: str = "cache_aware"  # requests over attention replicas (runtime/replicas/request_router.py)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            require(isinstance(v, int) and v > 0, f"scheduler.{name}", v, "must be a positive integer")
        require(self.routing in ROUTINGS, "scheduler.routing", self.routing,
                 f"must be one of {', '.join(ROUTINGS)}")
        if not self.enable_chunked_prefill:
            require(self.max_num_batched_tokens >= self.max_model_len,
                     "scheduler.max_num_batched_tokens", self.max_num_batched_tokens,
                     f"must be >= max_model_len={self.max_model_len} without chunked prefill")


DEPLOY_MODES = ("single", "colocated", "disaggregated")


@dataclass(frozen=True)
class DeployPlan:
    """How ranks are split: attention replicas x TP, then expert ranks (docs/design_rules.md)."""

    mode: str = "single"  # single | colocated | disaggregated (launcher: auto, the planner picks)
    attention_replicas: int = 1  # data-parallel attention replicas
    attention_tp: int = 1  # tensor-parallel ranks per attention replica
    expert_ranks: int = 0  # expert-parallel ranks (disaggregated mode)
    micro_batches: int = 1  # micro-batches in flight in the ping-pong pipeline
    # prefill-decode disaggregation (docs/pd.md); 0: off; deploy=auto's null: the planner's
    # when it plans a server (slo.arrival_rate), else 0
    prefill_replicas: int = 0
    prefill_tp: int = 1  # tensor-parallel ranks per prefill replica

    def __post_init__(self):
        require(self.mode in DEPLOY_MODES, "deploy.mode", self.mode,
                 f"must be one of {', '.join(DEPLOY_MODES)}")
        for name in ("attention_replicas", "attention_tp", "micro_batches"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= 1, f"deploy.{name}", v, "must be an integer >= 1")
        require(isinstance(self.expert_ranks, int) and self.expert_ranks >= 0,
                 "deploy.expert_ranks", self.expert_ranks, "must be an integer >= 0")
        if self.mode == "disaggregated":
            require(self.expert_ranks >= 1, "deploy.expert_ranks", self.expert_ranks,
                     "disaggregated mode needs at least one expert rank")
        if self.mode == "colocated":
            require(self.attention_tp == 1, "deploy.attention_tp", self.attention_tp,
                     "colocated mode runs data parallel attention only (attention_tp=1)")
        require(isinstance(self.prefill_replicas, int) and self.prefill_replicas >= 0,
                 "deploy.prefill_replicas", self.prefill_replicas, "must be an integer >= 0")
        require(isinstance(self.prefill_tp, int) and self.prefill_tp >= 1, "deploy.prefill_tp",
                 self.prefill_tp, "must be an integer >= 1")
        if self.prefill_replicas:
            require(self.mode == "disaggregated", "deploy.prefill_replicas", self.prefill_replicas,
                     f"prefill replicas hand off to disaggregated decode (deploy.mode={self.mode})")
        if self.mode == "single":
            require(self.world_size == 1, "deploy.mode", self.mode,
                     "single mode runs one process: attention_replicas=1, attention_tp=1, expert_ranks=0")

    @property
    def attention_ranks(self) -> int:
        return self.attention_replicas * self.attention_tp

    @property
    def prefill_ranks(self) -> int:
        return self.prefill_replicas * self.prefill_tp

    @property
    def world_size(self) -> int:
        if self.mode == "colocated":
            return self.attention_ranks
        return self.attention_ranks + self.expert_ranks + self.prefill_ranks

    def check_world_size(self, world: int) -> None:
        if world != self.world_size:
            raise ConfigError(
                f"world size {world} does not match deploy plan {self}: it needs "
                f"{self.world_size} ranks ({self.attention_replicas} attention replicas x tp "
                f"{self.attention_tp}" + (f" + {self.expert_ranks} expert ranks" if self.mode ==
                                          "disaggregated" else "")
                + (f" + {self.prefill_ranks} prefill ranks" if self.prefill_ranks else "") + ")")


@dataclass(frozen=True)
class EplbConfig:
    """Expert-parallel load balancing (``eplb.*``). ``redundant_experts`` extra physical slots
    hold replicas of hot experts; with ``enabled`` the expert ranks count tokens per expert
    over the last ``window`` iterations and every ``interval`` iterations move weights to a
    new placement. ``initial``: ``identity`` (or balanced for uniform load when redundant) or
    ``shuffled`` (a seeded random placement, for testing that placements change nothing)."""

    enabled: bool = False  # live rebalancing of expert placement (disaggregated mode)
    redundant_experts: int = 0  # extra physical expert slots holding replicas of hot experts
    window: int = 32  # iterations of load statistics a rebalance looks at
    interval: int = 64  # iterations between rebalances
    num_groups: Optional[int] = None  # None: the model's n_group (DeepSeek), else 1
    num_nodes: int = 1  # nodes the hierarchical placement packs expert groups into
    initial: str = "identity"  # identity | shuffled (a seeded random placement, for tests)
    seed: int = 0  # seed of the shuffled initial placement

    def __post_init__(self):
        require(isinstance(self.redundant_experts, int) and self.redundant_experts >= 0,
                 "eplb.redundant_experts", self.redundant_experts, "must be an integer >= 0")
        require(self.num_groups is None or (isinstance(self.num_groups, int)
                                             and self.num_groups >= 1),
                 "eplb.num_groups", self.num_groups, "must be null or an integer >= 1")
        for name in ("window", "interval", "num_nodes"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= 1, f"eplb.{name}", v, "must be an integer >= 1")
        require(self.initial in ("identity", "shuffled"), "eplb.initial", self.initial,
                 "must be identity or shuffled")

    def groups_for(self, model: "ModelConfig") -> int:
        """Expert groups the hierarchical policy packs by: ``num_groups``, else the model's
        routing groups (DeepSeek's ``n_group``), else 1."""
        return self.num_groups or getattr(model, "n_group", 1) or 1


@dataclass(frozen=True)
class CommConfig:
    """The M2N/N2M layer and the control plane (``comm.*``)."""

    timeout_s: float = 30.0  # a peer silent for longer is declared failed; the job aborts
    wait_mode: str = "backoff"  # spin | yield | backoff (megainfer.comm.wait)
    transport: str = "auto"  # auto | mpi | cuda_ipc | nccl (megainfer.comm.select; auto: mpi on cpu)
    # TP all-reduce/broadcast in a replica: auto (cuda: point to point over cuda_ipc when the job's
    # transport is auto or cuda_ipc; else MPI on host memory) | mpi | channel (runtime/tp/channel.py)
    tp_collectives: str = "auto"
    # expert weight moves of live EPLB and of a re-plan: auto (cuda: device to device over cuda_ipc
    # when the job's transport is auto or cuda_ipc; else MPI through host memory) | mpi | device
    # (cuda_ipc on cuda, the MPI transport on cpu; runtime/eplb/weight_channel.py)
    eplb_moves: str = "auto"

    def __post_init__(self):
        require(isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0, "comm.timeout_s",
                 self.timeout_s, "must be > 0")
        require(self.wait_mode in ("spin", "yield", "backoff"), "comm.wait_mode", self.wait_mode,
                 "must be spin, yield or backoff")
        require(self.transport in ("auto", "mpi", "cuda_ipc", "nccl"), "comm.transport",
                 self.transport, "must be auto, mpi, cuda_ipc or nccl")
        require(self.tp_collectives in ("auto", "mpi", "channel"), "comm.tp_collectives",
                 self.tp_collectives, "must be auto, mpi or channel")
        require(self.eplb_moves in ("auto", "mpi", "device"), "comm.eplb_moves",
                 self.eplb_moves, "must be auto, mpi or device")


@dataclass(frozen=True)
class TraceConfig:
    """Per-rank Chrome/Perfetto pipeline traces (``trace.*``), merged by rank 0."""

    enabled: bool = False
