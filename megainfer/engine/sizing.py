"""Derived sizes: max_model_len from the model, KV block count from a memory budget."""
from __future__ import annotations

from typing import Optional

import torch

from megainfer.config import CacheConfig, ConfigError, ModelConfig
from megainfer.kernels.attention_limits import kv_cache_limits_error
from megainfer.models.kv_spec import kv_cache_spec_for, kv_format_error

from .errors import CacheTooSmallError


def check_cache_fits(cache: CacheConfig, max_model_len: int) -> None:
    """Refuse at start-up a pool that cannot hold one request of max_model_len (no livelock)."""
    need = -(-max_model_len // cache.block_size)
    if cache.num_blocks < need:
        raise CacheTooSmallError(
            f"cache.num_blocks={cache.num_blocks}: a request of max_model_len={max_model_len} "
            f"tokens needs {need} blocks of {cache.block_size}; raise cache.num_blocks or lower "
            "scheduler.max_model_len")


def resolve_max_model_len(model: ModelConfig, requested: Optional[int]) -> int:
    """The requested length, or the model's max_position_embeddings; never beyond the latter."""
    if requested is None:
        return model.max_position_embeddings
    if not isinstance(requested, int) or requested < 1:
        raise ConfigError(f"scheduler.max_model_len={requested!r}: must be a positive integer")
    if requested > model.max_position_embeddings:
        raise ConfigError(f"scheduler.max_model_len={requested}: exceeds the model's "
                          f"max_position_embeddings={model.max_position_embeddings}")
    return requested


def check_kv_cache_dtype(model: ModelConfig, kv_cache_dtype: str,
                         attention_backend: Optional[str] = None) -> None:
    """ConfigError naming cache.kv_cache_dtype when this model (a head size fp4 cannot pack) or
    the chosen attention backend cannot store/read its cache in that format; a quantised cache
    never falls back to full precision."""
    why = kv_format_error(model, kv_cache_dtype)
    if why is None and attention_backend == "triton":
        why = kv_cache_limits_error(kv_cache_dtype, model.is_mla)
    if why:
        raise ConfigError(f"cache.kv_cache_dtype={kv_cache_dtype}: {why}")


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype,
                       kv_heads: Optional[int] = None, kv_cache_dtype: str = "auto",
                       kv_scale_granularity: str = "tensor") -> int:
    """All layers, one rank: from the model's cache spec (GQA: 2 x kv_heads x head_dim per
    token, ``kv_heads`` on this rank; MLA: one latent of kv_lora_rank + qk_rope_head_dim),
    stored in ``kv_cache_dtype`` (block scales and token_head row scales counted)."""
    check_kv_cache_dtype(model, kv_cache_dtype)
    spec = kv_cache_spec_for(model, kv_heads=kv_heads, kv_format=kv_cache_dtype,
                             kv_granularity=kv_scale_granularity)
    return block_size * spec.bytes_per_token(dtype)


def derive_num_blocks(model: ModelConfig, max_model_len: int, max_num_seqs: int, block_size: int,
                      memory_gib: float, dtype: torch.dtype = torch.float32,
                      kv_heads: Optional[int] = None, kv_cache_dtype: str = "auto",
                      kv_scale_granularity: str = "tensor") -> int:
    """Enough blocks for max_num_seqs requests of max_model_len, capped by memory_gib (bytes per
    block in ``kv_cache_dtype``: a low-bit cache holds more blocks at the same budget)."""
    per_seq = -(-max_model_len // block_size)
    cap = int(memory_gib * 2**30 // kv_bytes_per_block(model, block_size, dtype, kv_heads,
                                                       kv_cache_dtype, kv_scale_granularity))
    if cap < per_seq:
        raise CacheTooSmallError(
            f"cache.memory_gib={memory_gib}: holds {cap} KV blocks of {block_size} tokens, but one "
            f"request of max_model_len={max_model_len} needs {per_seq}; raise cache.memory_gib "
            "or lower scheduler.max_model_len")
    return min(per_seq * max_num_seqs, cap)
