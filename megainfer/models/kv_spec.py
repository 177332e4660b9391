"""What one layer's paged KV cache holds per token, published by the model.

* ``gqa``: keys and values per KV head, ``shape_per_token = (2, Hkv, D)``; a layer's cache is
  ``[2, num_blocks, block_size, Hkv, D]``.
* ``mla``: one latent per token shared by every head, ``(R + P,)`` = normalised ``c_kv`` then
  the rotated ``k_pe``; a layer's cache is ``[num_blocks, block_size, R + P]``; every TP rank
  keeps the whole latent.

Invariant: the block axis (``block_axis``, ``BLOCK_AXIS[kind]``: GQA 1, MLA 0) is owned here;
whoever selects, gathers or copies blocks reads it from the spec. ``kv_format`` and
``kv_granularity`` give the storage format (``bytes_per_token`` counts block and inline scales).
docs/design_rules.md, "The KV cache spec"; docs/kv_cache.md, "Layouts"."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megainfer.kernels import kv_quant

KINDS = ("gqa", "mla")
BLOCK_AXIS = {"gqa": 1, "mla": 0}  # the num_blocks dimension of a layer's cache tensor


@dataclass(frozen=True)
class KVCacheSpec:
    kind: str  # gqa | mla
    shape_per_token: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    num_layers: int = 1
    kv_format: str = "auto"  # cache.kv_cache_dtype
    parts: tuple[int, ...] = ()  # mla: (R, P), quantised apart (own scale, own 16-blocks)
    kv_granularity: str = "tensor"  # cache.kv_scale_granularity: tensor | token_head

    def __post_init__(self):
        if self.kv_format not in kv_quant.FORMATS:
            raise ValueError(f"kv_cache_dtype={self.kv_format!r}: must be one of "
                             f"{', '.join(kv_quant.FORMATS)}")
        if self.kv_granularity not in kv_quant.GRANULARITIES:
            raise ValueError(f"kv_scale_granularity={self.kv_granularity!r}: must be one of "
                             f"{', '.join(kv_quant.GRANULARITIES)}")
        if self.kind not in KINDS:
            raise ValueError(f"kv cache kind={self.kind!r}: must be one of {KINDS}")
        want = 3 if self.kind == "gqa" else 1
        if len(self.shape_per_token) != want or min(self.shape_per_token) < 1:
            raise ValueError(f"kv cache shape_per_token={self.shape_per_token}: {self.kind} wants "
                             f"{want} positive sizes")

    @property
    def block_axis(self) -> int:
        """The dimension of a layer's cache that indexes blocks (``layer_shape``: GQA 1, MLA 0)."""
        return BLOCK_AXIS[self.kind]

    def stored_row(self) -> int:
        """Storage elements of one row (GQA: one head's D; MLA: the latent)."""
        f, g = self.kv_format, self.kv_granularity
        if self.kind == "gqa":
            return kv_quant.stored_dim(f, self.shape_per_token[2], g)
        parts = self.parts or self.shape_per_token
        return sum(kv_quant.stored_dim(f, p, g) for p in parts)

    def layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if self.kind == "gqa":
            two, heads, _ = self.shape_per_token
            return (two, num_blocks, block_size, heads, self.stored_row())
        return (num_blocks, block_size, self.stored_row())

    def storage_dtype(self, dtype: Optional[torch.dtype] = None) -> torch.dtype:
        return kv_quant.storage_dtype(self.kv_format, dtype or self.dtype)

    def bytes_per_token(self, dtype: Optional[torch.dtype] = None) -> int:
        """All layers: what one cached token costs on this rank (block scales included)."""
        elt = torch.empty(0, dtype=self.storage_dtype(dtype)).element_size()
        rows = math.prod(self.shape_per_token[:-1])
        return self.num_layers * rows * self.stored_row() * elt

    def allocate(self, num_blocks: int, block_size: int, device=None,
                 dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
        """One zeroed cache tensor per layer (a quantised one with fresh, unset scales), on
        ``device`` (None: torch's default device)."""
        shape = self.layer_shape(num_blocks, block_size)
        caches = [torch.zeros(shape, dtype=self.storage_dtype(dtype), device=device)
                  for _ in range(self.num_layers)]
        if self.kv_format != "auto":
            for c in caches:
                kv_quant.register(c, self.kv_granularity)
        return caches


def kv_head_slice(num_kv_heads: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """The one rule for which KV heads an attention TP rank holds: (first KV head, count),
    contiguous slices, each head replicated when tp > num_kv_heads (``layers.SelfAttention``,
    the cache spec, the KV memory sizing and PD's KV routes all read it)."""
    return tp_rank * num_kv_heads // tp, max(1, num_kv_heads // tp)


def kv_cache_spec_for(cfg, tp_size: int = 1, dtype: torch.dtype = torch.float32,
                      kv_heads: Optional[int] = None, kv_format: str = "auto",
                      kv_granularity: str = "tensor") -> KVCacheSpec:
    """The spec of a ``ModelConfig`` on one TP rank (GQA heads split over ranks; MLA: whole
    latent on every rank). ``kv_heads`` overrides the per-rank GQA head count."""
    if cfg.is_mla:
        R, P = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        return KVCacheSpec("mla", (R + P,), dtype, cfg.num_layers, kv_format, (R, P),
                           kv_granularity)
    heads = kv_heads or kv_head_slice(cfg.num_kv_heads, tp_size, 0)[1]
    return KVCacheSpec("gqa", (2, heads, cfg.head_dim), dtype, cfg.num_layers, kv_format,
                       kv_granularity=kv_granularity)


def kv_format_error(cfg, kv_format: str) -> Optional[str]:
    """Why a model's cache cannot be stored in ``kv_format`` (None: it can)."""
    if kv_format != "fp4_e2m1":
        return None
    sizes = ({"kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim}
             if cfg.is_mla else {"head_dim": cfg.head_dim})
    bad = {k: v for k, v in sizes.items() if v % kv_quant.FP4_BLOCK}
    if bad:
        return ("fp4_e2m1 packs blocks of 16 values along the head dimension; this model's "
                + ", ".join(f"{k}={v}" for k, v in bad.items()) + " is not a multiple of 16")
    return None
