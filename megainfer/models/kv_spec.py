"""What one layer's paged KV cache holds per token, published by the model (docs/design_rules.md).

* ``gqa``: keys and values per KV head, ``shape_per_token = (2, Hkv, D)``; a layer's cache is
  ``[2, num_blocks, block_size, Hkv, D]`` (the layout the GQA torch and Triton paths read).
* ``mla``: one latent per token shared by every head, ``shape_per_token = (R + P,)`` =
  normalised ``c_kv`` (kv_lora_rank) then the rotated ``k_pe`` (qk_rope_head_dim); a layer's
  cache is ``[num_blocks, block_size, R + P]``. Every TP rank keeps the whole latent.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

KINDS = ("gqa", "mla")


@dataclass(frozen=True)
class KVCacheSpec:
    kind: str  # gqa | mla
    shape_per_token: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    num_layers: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kv cache kind={self.kind!r}: must be one of {KINDS}")
        want = 3 if self.kind == "gqa" else 1
        if len(self.shape_per_token) != want or min(self.shape_per_token) < 1:
            raise ValueError(f"kv cache shape_per_token={self.shape_per_token}: {self.kind} wants "
                             f"{want} positive sizes")

    def layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if self.kind == "gqa":
            two, heads, dim = self.shape_per_token
            return (two, num_blocks, block_size, heads, dim)
        return (num_blocks, block_size, *self.shape_per_token)

    def bytes_per_token(self, dtype: Optional[torch.dtype] = None) -> int:
        """All layers: what one cached token costs on this rank."""
        elt = torch.empty(0, dtype=dtype or self.dtype).element_size()
        return self.num_layers * math.prod(self.shape_per_token) * elt

    def allocate(self, num_blocks: int, block_size: int, device="cpu",
                 dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
        """One zeroed cache tensor per layer."""
        shape = self.layer_shape(num_blocks, block_size)
        return [torch.zeros(shape, dtype=dtype or self.dtype, device=device)
                for _ in range(self.num_layers)]


def kv_cache_spec_for(cfg, tp_size: int = 1, dtype: torch.dtype = torch.float32,
                      kv_heads: Optional[int] = None) -> KVCacheSpec:
    """The spec of a ``ModelConfig`` on one TP rank (GQA heads split over ranks; MLA: whole
    latent on every rank). ``kv_heads`` overrides the per-rank GQA head count."""
    if cfg.is_mla:
        return KVCacheSpec("mla", (cfg.kv_lora_rank + cfg.qk_rope_head_dim,), dtype, cfg.num_layers)
    heads = kv_heads or max(1, cfg.num_kv_heads // tp_size)
    return KVCacheSpec("gqa", (2, heads, cfg.head_dim), dtype, cfg.num_layers)
