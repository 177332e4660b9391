"""Model shapes: the architecture numbers the performance model needs, and the byte counts.

Parameter counts are per layer unless named otherwise. Attention-side per layer: q/k/v/o
projections and the router (plus shared experts, which run on attention ranks). Expert side:
one routed expert = gate, up, down = 3 * hidden * moe_intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass

from megainfer.config import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


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
    source: str = ""

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

    def attention_side_params(self) -> int:
        """Everything an attention replica holds: layers' attention + router + shared, embeddings."""
        per_layer = self.attn_params + self.router_params + self.shared_params + 2 * self.hidden_size
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        return self.attention_side_params() + self.num_layers * self.num_experts * self.expert_params

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
