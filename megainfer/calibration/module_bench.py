"""Calibration benches that time the project's own modules (``calibrate.bench=megainfer``):
one decode micro-batch through a ``DecoderLayer``'s attention half over a paged KV cache plus
the router, and ``RoutedExperts`` (``megainfer.kernels.fused_moe``) with ``b`` tokens on each
local expert. Same signatures as the plain-torch benches in ``layer_bench``."""
from __future__ import annotations

from typing import Callable

import torch

from .layer_bench import _DT, _rotating, register_bench


def _config(shape, experts: int):
    from megainfer.config import ModelConfig
    return ModelConfig(family="mixtral", vocab_size=max(shape.vocab_size, 16),
                       hidden_size=shape.hidden_size, num_layers=1, num_heads=shape.num_heads,
                       num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                       num_experts=max(shape.num_experts, experts), top_k=shape.top_k,
                       moe_intermediate_size=shape.moe_intermediate_size,
                       max_position_embeddings=1 << 20)


def module_attention(shape, b: int, ctx: int, dtype: str = "float32", copies: int = 1) -> Callable[[], None]:
    return _rotating([_attention_copy(shape, b, ctx, _DT[dtype], s) for s in range(copies)])


def _attention_copy(shape, b, ctx, dt, seed):
    from megainfer.config import LoadConfig
    from megainfer.models import AttentionMetadata, allocate_kv_cache, build_model
    cfg = _config(shape, shape.num_experts)
    layer = build_model(cfg, LoadConfig(load_format="dummy", seed=seed), role="attention").layers[0]
    layer.to(dt)
    bs = 16
    nb = (ctx + 1 + bs - 1) // bs
    kv = allocate_kv_cache(1, b * nb, bs, cfg.num_kv_heads, cfg.head_dim, dt)[0].normal_()
    meta = AttentionMetadata.build([1] * b, [ctx] * b, [list(range(i * nb, (i + 1) * nb))
                                                        for i in range(b)], bs)
    x = torch.randn(b, cfg.hidden_size, dtype=dt)
    pos = torch.full((b,), ctx)

    @torch.inference_mode()
    def run():
        y, _ = layer.pre_mlp(x, pos, meta, kv)  # [b, H]
        layer.mlp.gate(y)
    return run


def module_experts(shape, b: int, experts: int, dtype: str = "float32", copies: int = 1) -> Callable[[], None]:
    return _rotating([_experts_copy(shape, b, experts, _DT[dtype], s) for s in range(copies)])


def _experts_copy(shape, b, experts, dt, seed):
    from megainfer.config import LoadConfig
    from megainfer.models import build_model
    cfg = _config(shape, experts)
    ex = build_model(cfg, LoadConfig(load_format="dummy", seed=seed), role="experts",
                     expert_slots=[list(range(experts))]).layers[0].mlp.experts
    ex.to(dt)
    ids = torch.arange(experts).repeat_interleave(b)[:, None]  # b tokens on every local expert
    x = torch.randn(experts * b, cfg.hidden_size, dtype=dt)
    w = torch.ones(experts * b, 1, dtype=dt)

    @torch.inference_mode()
    def run():
        ex(x, w, ids)
    return run


register_bench("megainfer", module_attention, module_experts)
