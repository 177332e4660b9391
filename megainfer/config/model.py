"""``ModelConfig``: the architecture of one MoE checkpoint, read from its HF ``config.json``
(Mixtral, Qwen3-MoE, Qwen2-MoE, DeepSeek-V2/V3 with MLA and YaRN)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from .base import (MLA_FAMILIES, SUPPORTED_FAMILIES, ConfigError,
                   require)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (``rope_scaling`` / ``rope_parameters`` with type ``yarn``), HF names.
    ``factor`` None: max_position_embeddings / original_max_position_embeddings (as HF)."""

    factor: Optional[float]
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True

    def __post_init__(self):
        require(self.factor is None or self.factor > 0, "rope_scaling.factor", self.factor,
                 "must be > 0")
        require(isinstance(self.original_max_position_embeddings, int)
                 and self.original_max_position_embeddings > 0,
                 "rope_scaling.original_max_position_embeddings",
                 self.original_max_position_embeddings, "must be a positive integer")
        for name in ("beta_fast", "beta_slow"):
            v = getattr(self, name)
            require(v > 0, f"rope_scaling.{name}", v, "must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one MoE checkpoint, read from its HF ``config.json``."""

    family: str  # mixtral | qwen3_moe | qwen2_moe | deepseek_v2 | deepseek_v3 (HF model_type)
    vocab_size: int  # tokens in the vocabulary
    hidden_size: int  # width of the residual stream
    num_layers: int  # decoder layers (HF num_hidden_layers)
    num_heads: int  # attention query heads
    num_kv_heads: int  # key/value heads (HF num_key_value_heads; GQA when fewer than num_heads)
    head_dim: int  # width of one attention head
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    moe_intermediate_size: int  # width of one routed expert's MLP
    intermediate_size: int = 0  # dense MLP width (dense layers only)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    qk_norm: bool = False  # RMSNorm on queries and keys per head (Qwen3)
    attention_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_theta: float = 10000.0  # RoPE base frequency
    max_position_embeddings: int = 4096  # longest context the model was built for
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts (Qwen)
    decoder_sparse_step: int = 1  # every k-th layer is MoE (Qwen)
    bos_token_id: Optional[int] = None  # beginning-of-sequence token
    eos_token_id: tuple[int, ...] = ()  # end-of-sequence tokens (any of them stops a request)
    # DeepSeek-V3 (MLA, sigmoid routing); kv_lora_rank > 0 means MLA attention (docs/deepseek_v3.md)
    q_lora_rank: Optional[int] = None  # MLA query compression rank (None: queries not compressed)
    kv_lora_rank: int = 0  # MLA latent width cached per token (0: not MLA)
    qk_nope_head_dim: int = 0  # MLA query/key width without RoPE
    qk_rope_head_dim: int = 0  # MLA query/key width with RoPE (shared key part)
    v_head_dim: int = 0  # MLA value width per head
    n_group: int = 1  # expert groups for group-limited routing (DeepSeek)
    topk_group: int = 1  # groups a token's experts may come from (DeepSeek)
    routed_scaling_factor: float = 1.0  # scale on the routed experts' output (DeepSeek)
    first_k_dense_replace: int = 0  # leading layers with a dense MLP (DeepSeek)
    moe_layer_freq: int = 1  # every k-th layer after those is MoE (DeepSeek)
    n_shared_experts: int = 0  # ungated shared experts of width n_shared_experts * moe_inter
    scoring: str = "softmax"  # softmax | sigmoid (+ e_score_correction_bias)
    # softmax with n_group > 1 (DeepSeek-V2 group_limited_greedy): keep the topk_group groups
    # with the largest max score; sigmoid groups rank by the sum of their top-2 biased scores
    rope_scaling: Optional[YarnScaling] = None  # YaRN RoPE scaling (MLA families), else None
    rope_interleave: bool = False  # RoPE on interleaved pairs, as DeepSeek's checkpoints store q/k
    mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint (skipped at load)

    def __post_init__(self):
        require(self.family in SUPPORTED_FAMILIES, "model.family", self.family,
                 f"unsupported; supported families: {', '.join(SUPPORTED_FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "num_experts", "top_k", "moe_intermediate_size",
                     "max_position_embeddings", "decoder_sparse_step"):
            v = getattr(self, name)
            require(isinstance(v, int) and v > 0, f"model.{name}", v, "must be a positive integer")
        require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads,
                 f"must divide num_heads={self.num_heads}")
        require(self.top_k <= self.num_experts, "model.top_k", self.top_k,
                 f"must be <= num_experts={self.num_experts}")
        require(self.rms_norm_eps > 0, "model.rms_norm_eps", self.rms_norm_eps, "must be > 0")
        require(self.scoring in ("softmax", "sigmoid"), "model.scoring", self.scoring,
                 "must be softmax or sigmoid")
        for name in ("first_k_dense_replace", "n_shared_experts", "mtp_layers"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= 0, f"model.{name}", v, "must be an integer >= 0")
        require(isinstance(self.moe_layer_freq, int) and self.moe_layer_freq >= 1,
                 "model.moe_layer_freq", self.moe_layer_freq, "must be an integer >= 1")
        require(self.routed_scaling_factor > 0, "model.routed_scaling_factor",
                 self.routed_scaling_factor, "must be > 0")
        require(isinstance(self.n_group, int) and self.n_group >= 1
                 and self.num_experts % self.n_group == 0, "model.n_group", self.n_group,
                 f"must be a positive divisor of num_experts={self.num_experts}")
        require(isinstance(self.topk_group, int) and 1 <= self.topk_group <= self.n_group,
                 "model.topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
        require(self.top_k <= self.topk_group * (self.num_experts // self.n_group), "model.top_k",
                 self.top_k, f"more than the topk_group={self.topk_group} kept groups hold")
        if self.family in MLA_FAMILIES:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                v = getattr(self, name)
                require(isinstance(v, int) and v > 0, f"model.{name}", v,
                         "must be a positive integer (MLA)")
            require(self.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim",
                     self.qk_rope_head_dim, "must be even (RoPE rotates pairs)")
            require(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int)
                                                  and self.q_lora_rank > 0),
                     "model.q_lora_rank", self.q_lora_rank, "must be None or a positive integer")
        else:
            require(self.rope_scaling is None, "config.json rope_type", "yarn",
                     f"only default RoPE is supported for {self.family}")
            require(self.kv_lora_rank == 0, "model.kv_lora_rank", self.kv_lora_rank,
                     f"MLA is only supported for {' and '.join(MLA_FAMILIES)}, not {self.family}")
        if self.dense_layers():
            require(self.intermediate_size > 0, "model.intermediate_size", self.intermediate_size,
                     "dense layers need a positive intermediate_size")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek): one cached latent per token."""
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        """HF Qwen rule (sparse unless listed in mlp_only_layers or off the sparse step) and the
        DeepSeek rule (dense below first_k_dense_replace, then every moe_layer_freq-th layer)."""
        if layer < self.first_k_dense_replace or layer % self.moe_layer_freq:
            return False
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def dense_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_moe_layer(i)]

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        family = cfg.get("model_type", "")
        require(family in SUPPORTED_FAMILIES, "config.json model_type", family,
                 f"unsupported; supported families: {', '.join(SUPPORTED_FAMILIES)}")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", family == "mixtral"):
            raise ConfigError(f"config.json sliding_window={cfg['sliding_window']!r}: "
                              "sliding-window attention is not supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if family in MLA_FAMILIES:
            return _deepseek_from_hf(cls, cfg, rope, rope_type)
        require(rope_type == "default", "config.json rope_type", rope_type,
                 "only default RoPE is supported")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        experts = cfg.get("num_local_experts") or cfg.get("num_experts")
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        if family == "mixtral":
            moe_inter, inter, shared, norm_topk = cfg["intermediate_size"], 0, 0, True
        else:
            moe_inter, inter = cfg["moe_intermediate_size"], cfg.get("intermediate_size", 0)
            shared = cfg.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
            norm_topk = bool(cfg.get("norm_topk_prob", False))
        return cls(
            family=family, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            num_experts=experts, top_k=cfg["num_experts_per_tok"],
            moe_intermediate_size=moe_inter, intermediate_size=inter or 0,
            shared_expert_intermediate_size=shared or 0, norm_topk_prob=norm_topk,
            qk_norm=family == "qwen3_moe",
            attention_bias=bool(cfg.get("qkv_bias", cfg.get("attention_bias", family == "qwen2_moe"))),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        if not os.path.isdir(path):
            raise ConfigError(f"model.path={path!r}: no such directory")
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"model.path={path!r}: no config.json in that directory")
        with open(cfg_path) as f:
            return cls.from_hf_dict(json.load(f))


def _eos(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def _get(cfg: dict, key: str, default):
    """cfg[key], or default when the key is missing or null (HF writes None for unset)."""
    v = cfg.get(key)
    return default if v is None else v


def _deepseek_from_hf(cls, cfg: dict, rope: dict, rope_type: str) -> ModelConfig:
    """DeepSeek-V2/V3 ``config.json`` (HF names; the original checkpoint's ``rope_scaling`` or
    transformers 5's ``rope_parameters``). V3: sigmoid + correction bias, group top-2 sums.
    V2 (HF ``DeepseekV2TopkRouter``): softmax, ``greedy`` or ``group_limited_greedy`` (group
    max), never renormalised whatever ``norm_topk_prob`` says, then routed_scaling_factor."""
    family = cfg["model_type"]
    require(rope_type in ("default", "yarn"), "config.json rope_type", rope_type,
             f"{family} supports default or yarn RoPE")
    v3 = family == "deepseek_v3"
    scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
    require(scoring == ("sigmoid" if v3 else "softmax"), "config.json scoring_func", scoring,
             f"{family} routes with {'sigmoid' if v3 else 'softmax'} scores")
    method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
    require(method in (("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")),
             "config.json topk_method", method, f"not supported for {family}")
    grouped = v3 or method == "group_limited_greedy"
    require(not cfg.get("mlp_bias"), "config.json mlp_bias", cfg.get("mlp_bias"),
             "MLP biases are not supported")
    scaling = None
    if rope_type == "yarn":
        omax = rope.get("original_max_position_embeddings",
                        cfg.get("original_max_position_embeddings",
                                cfg.get("max_position_embeddings", 4096)))
        scaling = YarnScaling(
            factor=None if rope.get("factor") is None else float(rope["factor"]),
            original_max_position_embeddings=omax,
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
            attention_factor=rope.get("attention_factor"),
            truncate=bool(rope.get("truncate", True)))
    heads = cfg["num_attention_heads"]
    nope, rot = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    return cls(
        family=family, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
        head_dim=nope + rot,
        num_experts=cfg.get("n_routed_experts") or cfg.get("num_local_experts"),
        top_k=cfg["num_experts_per_tok"], moe_intermediate_size=cfg["moe_intermediate_size"],
        intermediate_size=cfg.get("intermediate_size", 0) or 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) and v3,
        attention_bias=bool(cfg.get("attention_bias", False)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=_eos(cfg),
        q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=nope, qk_rope_head_dim=rot, v_head_dim=cfg["v_head_dim"],
        n_group=_get(cfg, "n_group", 1) if grouped else 1,
        topk_group=_get(cfg, "topk_group", 1) if grouped else 1,
        routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", 1.0)),
        first_k_dense_replace=_get(cfg, "first_k_dense_replace", 0),
        moe_layer_freq=_get(cfg, "moe_layer_freq", 1),
        n_shared_experts=_get(cfg, "n_shared_experts", 0), scoring=scoring,
        rope_scaling=scaling, rope_interleave=bool(cfg.get("rope_interleave", True)),  # V2: always
        mtp_layers=cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0)
