"""The HBM bytes one decode step must read, for ``perf/bench/bench_gpu_engine.py``'s roofline, and
the model shapes that bench runs (``MODELS``: presets cut to a few layers; ``tiny``: the CPU smoke
test's widths on the same families and routing).

  bytes = non-expert weights (attention, norms, routers, dense MLPs, lm_head; of the embedding
          only the b rows looked up) + expected distinct experts touched per MoE layer,
          E * (1 - (1 - k/E)^b) for b tokens routed uniformly top-k over E experts, times one
          expert's weights + KV read: b * ctx * layers * 2 * kv_heads * head_dim * dtype bytes.
"""
from __future__ import annotations

import dataclasses

from megainfer.config import ModelConfig

from .shapes import preset_model

MODELS = ("mixtral_8x7b", "qwen3_30b_a3b")  # conf/model presets
TINY = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, moe_intermediate_size=64,
            vocab_size=512, bos_token_id=1, eos_token_id=(2,))


def model_config(name: str, layers: int, tiny: bool) -> ModelConfig:
    cfg = dataclasses.replace(preset_model(name), num_layers=layers)
    if tiny:
        E = min(cfg.num_experts, 16)
        cfg = dataclasses.replace(cfg, **TINY, num_experts=E, top_k=min(cfg.top_k, E // 4),
                                  intermediate_size=128 if cfg.intermediate_size else 0)
    return cfg


def decode_roofline(cfg: ModelConfig, b: int, ctx: float, elt: int) -> dict:
    """HBM bytes one decode step of b sequences at mean context ctx must read, ``elt`` bytes an
    element (see the module docstring)."""
    H, D, V, L = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    attn = H * (q + 2 * kv) + q * H + 2 * H + (2 * D if cfg.qk_norm else 0)
    attn += (q + 2 * kv) if cfg.attention_bias else 0
    S = cfg.shared_expert_intermediate_size
    n_moe, n_dense = len(cfg.moe_layers()), len(cfg.dense_layers())
    E, k = cfg.num_experts, cfg.top_k
    touched = E * (1 - (1 - k / E) ** b)
    non_expert = (L * attn + n_moe * (H * E + (3 * H * S + H if S else 0))
                  + n_dense * 3 * H * cfg.intermediate_size + H + V * H + b * H)
    expert = n_moe * touched * 3 * H * cfg.moe_intermediate_size
    kv_read = b * ctx * L * 2 * kv
    return dict(experts_touched_per_layer=touched, weight_bytes=(non_expert + expert) * elt,
                kv_bytes=kv_read * elt, bytes_per_step=(non_expert + expert + kv_read) * elt)
