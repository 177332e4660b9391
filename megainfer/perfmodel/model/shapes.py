"""Model shapes: the architecture numbers the performance model needs, and the byte counts.

Parameter counts are per layer unless named otherwise: attention side = q/k/v/o projections,
the router and the shared experts (which run on attention ranks); one routed expert = gate,
up, down = 3 * hidden * moe_intermediate. KV bytes follow ``cache.kv_cache_dtype`` as the
engine's cache stores them (``auto`` the model dtype, fp8 1 byte, ``fp4_e2m1`` 9/16 byte per
element; ``token_head`` adds each row's inline scale: 2 bytes fp8, 1 fp4). Weight bytes follow
``model.quantization`` (``weight_format.py``): attention projections (but
``attn_unquantised_params``), shared and routed experts in that format, embeddings,
``lm_head``, norms and routers in the model dtype (``attention_side_bytes``, ``expert_bytes``).
docs/perfmodel.md, "Weight formats".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megainfer.config import ConfigError
from megainfer.config.base import check_weight_format
from megainfer.perfmodel.model.weight_format import bytes_per_weight

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
# cache.kv_cache_dtype -> bytes per cached element (None: the model dtype); fp4: (D/2 + D/16) / D
KV_CACHE_BYTES = {"auto": None, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "fp4_e2m1": 9 / 16}
# cache.kv_scale_granularity=token_head: bytes of each stored row's inline scale
KV_ROW_SCALE_BYTES = {"auto": 0, "fp8_e4m3": 2, "fp8_e5m2": 2, "fp4_e2m1": 1}
FP4_BLOCK = 16  # values per E4M3 block scale along a KV row


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int  # MoE layers the pipeline runs (dense layers counted as MoE: see docs)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    vocab_size: int
    shared_intermediate_size: int = 0  # total width of shared experts (0: none)
    attn_params_override: int = 0  # per layer, e.g. MLA; 0: GQA q/k/v/o from the dims
    kv_elems_override: int = 0  # KV-cache elements per token per layer; 0: 2*kv_heads*head_dim
    kv_cache_dtype: str = "auto"  # cache.kv_cache_dtype: how the KV cache stores its elements
    source: str = ""
    kv_scale_granularity: str = "token_head"  # cache.kv_scale_granularity: tensor | token_head
    quantization: Optional[str] = None  # model.quantization: the stored weights' format
    quantization_group_size: int = 64  # model.quantization_group_size (int4)
    attn_unquantised_params: int = 0  # per layer, attention weights kept in the model dtype (MLA kv_b)

    def __post_init__(self):
        for n in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "num_experts", "top_k", "moe_intermediate_size", "vocab_size"):
            v = getattr(self, n)
            if not (isinstance(v, int) and v > 0):
                raise ConfigError(f"model.{n}={v!r}: must be a positive integer")
        if self.top_k > self.num_experts:
            raise ConfigError(f"model.top_k={self.top_k}: must be <= num_experts={self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_kv_heads={self.num_kv_heads}: must divide num_heads={self.num_heads}")
        if self.kv_cache_dtype not in KV_CACHE_BYTES:
            raise ConfigError(f"cache.kv_cache_dtype={self.kv_cache_dtype!r}: must be one of "
                              f"{', '.join(KV_CACHE_BYTES)}")
        if self.kv_cache_dtype == "fp4_e2m1":  # the 4-bit layout packs rows of 16-value blocks
            key, row = (("kv_elems_override", self.kv_elems_override) if self.kv_elems_override
                        else ("head_dim", self.head_dim))
            if row % FP4_BLOCK:
                raise ConfigError(f"cache.kv_cache_dtype=fp4_e2m1: packs blocks of {FP4_BLOCK} "
                                  f"values along a KV row; model.{key}={row} is not a multiple "
                                  f"of {FP4_BLOCK}")
        if self.kv_scale_granularity not in ("tensor", "token_head"):
            raise ConfigError(f"cache.kv_scale_granularity={self.kv_scale_granularity!r}: must "
                              "be one of tensor, token_head")
        check_weight_format(self.quantization, self.quantization_group_size)
        if not 0 <= self.attn_unquantised_params <= self.attn_params:
            raise ConfigError(f"model.attn_unquantised_params={self.attn_unquantised_params!r}: "
                              f"must be in [0, attention parameters per layer = {self.attn_params}]")

    # ---- parameter counts ----
    @property
    def attn_params(self) -> int:
        """q, k, v, o projections per layer."""
        if self.attn_params_override:
            return self.attn_params_override
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv)

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def shared_params(self) -> int:
        return 3 * self.hidden_size * self.shared_intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed expert, one layer."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def kv_elems(self) -> int:
        """KV-cache elements per token per layer (whole model, before TP split)."""
        return self.kv_elems_override or 2 * self.num_kv_heads * self.head_dim

    def kv_elem_bytes(self, dtype: str = "bfloat16") -> float:
        """Bytes one cached KV element costs in ``kv_cache_dtype`` (``auto``: ``dtype``'s),
        block scales included (fp4: 9/16)."""
        b = KV_CACHE_BYTES[self.kv_cache_dtype]
        if b is None:
            return float(dtype_bytes(dtype))
        return b + self._row_scale_bytes() / self.kv_elems  # token_head scales, spread

    def _row_scale_bytes(self) -> int:
        """Inline scale bytes per token and layer (token_head): one per stored row, GQA
        2 x kv_heads rows, MLA 2 (c_kv, k_pe)."""
        if self.kv_scale_granularity != "token_head":
            return 0
        rows = 2 if self.kv_elems_override else 2 * self.num_kv_heads
        return rows * KV_ROW_SCALE_BYTES[self.kv_cache_dtype]

    def kv_bytes_per_token(self, dtype: str = "bfloat16", tp: int = 1) -> float:
        """All layers' KV bytes of one cached token on one attention rank of a TP group of
        ``tp`` (GQA heads split over min(tp, kv_heads) ranks; an MLA latent is whole on each)."""
        split = 1 if self.kv_elems_override else min(tp, self.num_kv_heads)
        b = KV_CACHE_BYTES[self.kv_cache_dtype]
        if b is None:
            return self.num_layers * self.kv_elems / split * float(dtype_bytes(dtype))
        return self.num_layers * (self.kv_elems * b + self._row_scale_bytes()) / split

    def attention_side_params(self) -> int:
        """Everything an attention replica holds: layers' attention + router + shared, embeddings."""
        per_layer = self.attn_params + self.router_params + self.shared_params + 2 * self.hidden_size
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        return self.attention_side_params() + self.num_layers * self.num_experts * self.expert_params

    # ---- weight bytes (quantization) ----
    def quant_weight_bytes(self, dtype: str = "bfloat16") -> float:
        """Bytes of one weight kept in ``quantization`` (scales included; the model dtype's
        when None / fp8_dequant)."""
        return bytes_per_weight(self.quantization, dtype_bytes(dtype), self.hidden_size,
                                self.quantization_group_size)

    def attention_layer_bytes(self, dtype: str = "bfloat16") -> tuple[float, float]:
        """(bytes of one layer's TP-split attention-side weights: projections + shared
        experts, bytes of its router), as stored."""
        q = self.attn_params - self.attn_unquantised_params + self.shared_params
        wb = dtype_bytes(dtype)
        return (q * self.quant_weight_bytes(dtype) + self.attn_unquantised_params * wb,
                self.router_params * wb)

    def attention_side_bytes(self, dtype: str = "bfloat16") -> float:
        """``attention_side_params`` as stored: quantised projections and shared experts, the
        rest (router, norms, embeddings, lm_head) in ``dtype``."""
        dense, router = self.attention_layer_bytes(dtype)
        wb = dtype_bytes(dtype)
        return (self.num_layers * (dense + router + 2 * self.hidden_size * wb)
                + 2 * self.vocab_size * self.hidden_size * wb)

    def expert_bytes(self, dtype: str = "bfloat16") -> float:
        """One routed expert, one layer, as stored."""
        return self.expert_params * self.quant_weight_bytes(dtype)

    def total_weight_bytes(self, dtype: str = "bfloat16") -> float:
        return (self.attention_side_bytes(dtype)
                + self.num_layers * self.num_experts * self.expert_bytes(dtype))

    @classmethod
    def from_dict(cls, d: dict, name: str = "model") -> "ModelShape":
        known = cls.__dataclass_fields__
        unknown = [k for k in d if k not in known]
        if unknown:
            raise ConfigError(f"model.{unknown[0]}: unknown key; known: {', '.join(known)}")
        missing = [k for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                               "num_experts", "top_k", "moe_intermediate_size", "vocab_size")
                   if d.get(k) is None]
        if missing:
            raise ConfigError(f"model.{missing[0]}: missing")
        return cls(**{"name": name, **d})

    @classmethod
    def from_model_config(cls, cfg, name: str = "model") -> "ModelShape":
        """From megainfer.config.ModelConfig (a real checkpoint's config.json)."""
        return cls(name=name, hidden_size=cfg.hidden_size, num_layers=len(cfg.moe_layers()),
                   num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   num_experts=cfg.num_experts, top_k=cfg.top_k,
                   moe_intermediate_size=cfg.moe_intermediate_size, vocab_size=cfg.vocab_size,
                   shared_intermediate_size=cfg.shared_expert_intermediate_size)


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype={dtype!r}: unknown; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]
