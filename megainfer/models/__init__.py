"""MoE model families with Hugging Face parameter names."""
from .attention import AttentionMetadata, allocate_kv_cache
from .layers import ParallelContext
from .loader import CheckpointError, build_model
from .model import MoECausalLM

__all__ = ["AttentionMetadata", "allocate_kv_cache", "ParallelContext", "CheckpointError",
           "build_model", "MoECausalLM"]
