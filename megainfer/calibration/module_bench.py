"""Calibration benches that time the project's own modules (``calibrate.bench=megainfer``):
one decode micro-batch through a ``DecoderLayer``'s attention half over a paged KV cache plus
the router, and ``RoutedExperts`` (``megainfer.kernels.fused_moe``) with ``b`` tokens on each
local expert. Same signatures as the plain-torch benches in ``torch_ops_bench``. ``megainfer_cuda``:
the same on the current GPU (Triton attention and fused MoE), each run synchronised."""
from __future__ import annotations

from typing import Callable

import torch

from megainfer.config.base import torch_dtype_of

from .torch_ops_bench import rotating


def _config(shape, experts: int):
    from megainfer.config import ModelConfig
    return ModelConfig(family="mixtral", vocab_size=max(shape.vocab_size, 16),
                       hidden_size=shape.hidden_size, num_layers=1, num_heads=shape.num_heads,
                       num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                       num_experts=max(shape.num_experts, experts), top_k=shape.top_k,
                       moe_intermediate_size=shape.moe_intermediate_size,
                       max_position_embeddings=1 << 20)


def module_attention(shape, b: int, ctx: int, dtype: str = "float32", copies: int = 1,
                     device: str = "cpu") -> Callable[[], None]:
    return rotating([_attention_copy(shape, b, ctx, torch_dtype_of(dtype), s, device) for s in range(copies)])


def _sync(device: str):
    """On cuda a run ends when the device is done (the bench times the wall clock)."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _attention_copy(shape, b, ctx, dt, seed, device="cpu"):
    from megainfer.config import LoadConfig
    from megainfer.models import AttentionMetadata, allocate_kv_cache, build_model
    cfg = _config(shape, shape.num_experts)
    model = build_model(cfg, LoadConfig(load_format="dummy", seed=seed), role="attention")
    if device == "cuda":
        model.to(device)
        model.set_attention_backend("triton")
    layer = model.layers[0]
    layer.to(dt)
    bs = 16
    nb = (ctx + 1 + bs - 1) // bs
    kv = allocate_kv_cache(1, b * nb, bs, cfg.num_kv_heads, cfg.head_dim, dt)[0].to(device).normal_()
    meta = AttentionMetadata.build([1] * b, [ctx] * b, [list(range(i * nb, (i + 1) * nb))
                                                        for i in range(b)], bs, device)
    x = torch.randn(b, cfg.hidden_size, dtype=dt, device=device)
    pos = torch.full((b,), ctx, device=device)
    sync = _sync(device)

    @torch.inference_mode()
    def run():
        y, _ = layer.pre_mlp(x, pos, meta, kv)  # [b, H]
        layer.mlp.gate(y)
        sync()
    return run


def module_experts(shape, b: int, experts: int, dtype: str = "float32", copies: int = 1,
                   device: str = "cpu") -> Callable[[], None]:
    return rotating([_experts_copy(shape, b, experts, torch_dtype_of(dtype), s, device) for s in range(copies)])


def _experts_copy(shape, b, experts, dt, seed, device="cpu"):
    from megainfer.config import LoadConfig
    from megainfer.models import build_model
    cfg = _config(shape, experts)
    ex = build_model(cfg, LoadConfig(load_format="dummy", seed=seed), role="experts",
                     expert_slots=[list(range(experts))]).layers[0].mlp.experts
    ex.to(device, dt)
    ex.init_buffers(device)
    ids = torch.arange(experts, device=device).repeat_interleave(b)[:, None]  # b tokens each
    x = torch.randn(experts * b, cfg.hidden_size, dtype=dt, device=device)
    w = torch.ones(experts * b, 1, dtype=dt, device=device)
    sync = _sync(device)

    @torch.inference_mode()
    def run():
        ex(x, w, ids)  # on cuda: the Triton fused-MoE kernels with the tuned tile table
        sync()
    return run

