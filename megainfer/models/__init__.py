"""MoE model families with Hugging Face parameter names."""
from .attention import AttentionMetadata, allocate_kv_cache
from .kv_spec import KVCacheSpec, kv_cache_spec_for
from .layers import ParallelContext
from .loader import CheckpointError, build_model
from .model import MoECausalLM

__all__ = ["AttentionMetadata", "allocate_kv_cache", "KVCacheSpec", "kv_cache_spec_for",
           "ParallelContext", "CheckpointError",
           "build_model", "MoECausalLM"]
