"""The plain-torch calibration bench (``calibrate.bench=torch_ops``): one layer's attention half
and its local experts written as bare torch ops at a model's shapes, no project module involved
(q/k/v/o projections + SDPA over the KV cache + router; gate_up / SiLU*mul / down per expert).
Each builder rotates over ``copies`` distinct layers so the working set is a real rank's.
``rotating`` is shared with the project-module bench (module_bench)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from megainfer.config.base import torch_dtype_of
from megainfer.perfmodel.model.shapes import ModelShape



def rotating(runs):
    """One callable that runs the next copy each call."""
    state = [0]

    def run():
        runs[state[0] % len(runs)]()
        state[0] += 1
    return run


def _rand(g, *shape, dt, scale=1.0):
    return torch.rand(*shape, generator=g, dtype=dt).sub_(0.5).mul_(2 * scale)


def torch_attention(shape: ModelShape, b: int, ctx: int, dtype: str = "float32",
                    copies: int = 1) -> Callable[[], None]:
    """One decode micro-batch through one layer's attention half; rotates over `copies` layers."""
    return rotating([_attention_copy(shape, b, ctx, torch_dtype_of(dtype), s) for s in range(copies)])


def _attention_copy(shape: ModelShape, b: int, ctx: int, dt, seed: int) -> Callable[[], None]:
    h, nh, nkv, d = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    g = torch.Generator().manual_seed(seed)
    w = lambda i, o: _rand(g, i, o, dt=dt, scale=i ** -0.5)  # noqa: E731
    wq, wk, wv, wo, wr = w(h, nh * d), w(h, nkv * d), w(h, nkv * d), w(nh * d, h), w(h, shape.num_experts)
    norm = torch.ones(h, dtype=dt)
    x = _rand(g, b, h, dt=dt)  # [b, H]
    kc = _rand(g, b, nkv, ctx, d, dt=dt)  # [b, kv, ctx, d]
    vc = _rand(g, b, nkv, ctx, d, dt=dt)

    def run():
        y = F.rms_norm(x, (h,), norm)  # [b, H]
        q = (y @ wq).view(b, nh, 1, d)  # [b, nh, 1, d]
        k = (y @ wk).view(b, nkv, 1, d)
        v = (y @ wv).view(b, nkv, 1, d)
        kc[:, :, -1:].copy_(k)  # write this step's KV
        vc[:, :, -1:].copy_(v)
        o = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)  # [b, nh, 1, d]
        x2 = x + o.reshape(b, nh * d) @ wo  # [b, H]
        y2 = F.rms_norm(x2, (h,), norm)
        torch.topk(torch.softmax(y2 @ wr, -1), shape.top_k, -1)  # router [b, E] -> top-k
    return run


def torch_experts(shape: ModelShape, b: int, experts: int, dtype: str = "float32",
                  copies: int = 1) -> Callable[[], None]:
    """`experts` local experts with b tokens each through one layer; rotates over `copies` layers."""
    return rotating([_experts_copy(shape, b, experts, torch_dtype_of(dtype), s) for s in range(copies)])


def _experts_copy(shape: ModelShape, b: int, experts: int, dt, seed: int) -> Callable[[], None]:
    h, i = shape.hidden_size, shape.moe_intermediate_size
    g = torch.Generator().manual_seed(seed)
    w13 = _rand(g, experts, h, 2 * i, dt=dt, scale=h ** -0.5)  # [e, H, 2I]
    w2 = _rand(g, experts, i, h, dt=dt, scale=i ** -0.5)  # [e, I, H]
    x = _rand(g, experts * b, h, dt=dt)  # tokens sorted by expert [e*b, H]
    wts = torch.rand(experts * b, 1, generator=g, dtype=dt)
    out = torch.zeros_like(x)

    def run():
        for e in range(experts):
            xs = x[e * b:(e + 1) * b]  # [b, H]
            gu = xs @ w13[e]  # [b, 2I]
            act = F.silu(gu[:, :i]) * gu[:, i:]  # [b, I]
            out[e * b:(e + 1) * b] = (act @ w2[e]) * wts[e * b:(e + 1) * b]  # [b, H]
    return run
