"""The decoder stack shared by Mixtral, Qwen3-MoE, Qwen2-MoE and DeepSeek-V3 (HF names).

A decoder layer is driven in halves so the runtime can put the routed experts elsewhere:
``pre_mlp`` (norm, attention, residual, norm) -> MLP input and residual; the runtime then runs
``mlp`` locally (single mode) or routes with ``mlp.gate``, ships tokens to expert ranks, adds
``mlp.shared(x)`` and the experts' partial sums back onto the residual.

Roles: ``full`` builds everything; ``attention`` builds everything but routed expert weights;
``experts`` builds only ``model.layers.N.mlp.experts`` for the given slots.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from megainfer.config import ModelConfig

from .attention import AttentionMetadata
from .attention_backends import TorchAttention, make_attention_backend
from .layers import GatedMLP, ParallelContext, RMSNorm, SelfAttention, linear
from .deepseek_v3 import MLAAttention
from .kv_spec import KVCacheSpec, kv_cache_spec_for
from .mla_attention import make_mla_backend
from .moe import MoEBlock, RoutedExperts

ROLES = ("full", "attention", "experts")


class ExpertsOnly(nn.Module):
    """What an expert rank holds of one MoE layer: ``mlp.experts`` and nothing else."""

    def __init__(self, cfg: ModelConfig, slots: Sequence[int], num_slots: int):
        super().__init__()
        self.experts = RoutedExperts(cfg.hidden_size, cfg.moe_intermediate_size, num_slots, slots)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, par: ParallelContext, role: str,
                 expert_slots: Optional[Sequence[int]], num_slots: int):
        super().__init__()
        self.layer_idx, self.is_moe = layer, cfg.is_moe_layer(layer)
        if role == "experts":
            if self.is_moe:
                self.mlp = ExpertsOnly(cfg, expert_slots, num_slots)
            return
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, par) if cfg.is_mla else SelfAttention(cfg, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_moe:
            self.mlp = MoEBlock(cfg, [] if role == "attention" else expert_slots, num_slots)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def pre_mlp(self, hidden: torch.Tensor, positions: torch.Tensor,
                meta: Optional[AttentionMetadata], kv_cache: Optional[torch.Tensor]):
        """hidden [T, H] -> (MLP input [T, H], residual [T, H])."""
        residual = hidden + self.self_attn(self.input_layernorm(hidden), positions, meta, kv_cache)
        return self.post_attention_layernorm(residual), residual

    def forward(self, hidden, positions, meta=None, kv_cache=None) -> torch.Tensor:
        x, residual = self.pre_mlp(hidden, positions, meta, kv_cache)
        return residual + self.mlp(x)


class DecoderStack(nn.Module):
    """``model.*``: embed_tokens, layers, norm."""

    def __init__(self, cfg, par, role, expert_slots, num_slots):
        super().__init__()
        if role != "experts":
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, par, role, None if expert_slots is None else expert_slots[i],
                         num_slots)
            for i in range(cfg.num_layers))


class MoECausalLM(nn.Module):
    """``model`` + ``lm_head``. ``expert_slots[layer]``: physical slots held (None: all);
    ``num_slots``: physical expert slots per layer (num_experts + redundant replicas)."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext = ParallelContext(), role: str = "full",
                 expert_slots: Optional[Sequence[Sequence[int]]] = None,
                 num_slots: Optional[int] = None):
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"role={role!r}: must be one of {ROLES}")
        self.config, self.par, self.role = cfg, par, role
        self.model = DecoderStack(cfg, par, role, expert_slots, num_slots or cfg.num_experts)
        self.attention_backend = make_mla_backend("torch") if cfg.is_mla else TorchAttention()
        if role != "experts":
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def set_attention_backend(self, name: str) -> None:
        """``torch`` | ``triton`` for every attention layer (megainfer.models.attention_backends)."""
        c = self.config
        backend = (make_mla_backend(name, c.kv_lora_rank, c.qk_rope_head_dim) if c.is_mla
                   else make_attention_backend(name))
        for layer in self.layers:
            if hasattr(layer, "self_attn"):
                layer.self_attn.attn_backend = backend
        self.attention_backend = backend

    def kv_cache_spec(self, dtype: Optional[torch.dtype] = None) -> KVCacheSpec:
        """What this rank caches per token and layer (GQA: its KV heads; MLA: the latent)."""
        if dtype is None:
            p = next(self.parameters(), None)
            dtype = p.dtype if p is not None else torch.float32
        return kv_cache_spec_for(self.config, self.par.tp_size, dtype)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: Optional[AttentionMetadata] = None,
                kv_caches: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
        """Everything local. input_ids, positions [T] -> final-normed hidden [T, H]."""
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, meta, None if kv_caches is None else kv_caches[i])
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32
        return linear(self.lm_head, hidden).float()
