"""Per-layer attention and expert timings at given batch sizes (the calibration's raw data).

A bench is a pair of builders, each returning a zero-argument callable that runs one layer once:
  make_attention(shape, b, ctx, dtype, copies) -> fn  # one decode micro-batch, b tokens, KV ctx
  make_experts(shape, b, experts, dtype, copies) -> fn # `experts` local experts, b tokens each
Each builder rotates over `copies` distinct layers (weights, KV cache), by default the model's
layer count, so the working set is a real rank's: timing one hot copy would measure the cache.
"torch_ops" times plain-torch ops at the model's shapes (q/k/v/o projections + SDPA over the KV
cache + router; gate_up / SiLU*mul / down per expert). When megainfer.models lands, register a
bench that builds the real modules under another name and pass bench=<name>: nothing else changes.
"""
from __future__ import annotations

import importlib
import random
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from megainfer.config import ConfigError
from megainfer.perfmodel.shapes import ModelShape

_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rotating(runs):
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
    return _rotating([_attention_copy(shape, b, ctx, _DT[dtype], s) for s in range(copies)])


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
    return _rotating([_experts_copy(shape, b, experts, _DT[dtype], s) for s in range(copies)])


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


BENCHES = {"torch_ops": (torch_attention, torch_experts)}


def register_bench(name: str, make_attention, make_experts) -> None:
    BENCHES[name] = (make_attention, make_experts)


def bench_fns(name: str) -> tuple:
    """(make_attention, make_experts) of a bench; the runtime's own modules ("megainfer", in
    module_bench) are registered on first use."""
    if name not in BENCHES:
        importlib.import_module("megainfer.calibration.module_bench")  # registers "megainfer"
    if name not in BENCHES:
        raise ConfigError(f"calibrate.bench={name!r}: unknown; known: {', '.join(BENCHES)}")
    return BENCHES[name]


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def time_fn(fn: Callable[[], None], repeats: int = 7, warmup: int = 2, min_time_s: float = 0.0,
            clock: str = "wall") -> float:
    """Median seconds of one call; each sample loops until min_time_s to beat timer noise.

    clock="thread" counts this thread's CPU time only: with torch on one thread it is the op's
    own cost, unaffected by other processes taking the core (the machine is shared)."""
    now = CLOCKS[clock]
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        n, t0 = 0, now()
        while True:
            fn()
            n += 1
            el = now() - t0
            if el >= min_time_s:
                break
        samples.append(el / n)
    return statistics.median(samples)


def measure_layers(shape: ModelShape, batches, ctxs, experts: int, bench: str = "torch_ops",
                   dtype: str = "float32", rounds: int = 3, repeats: int = 3,
                   copies: int = 0, clock: str = "thread", seed: int = 0) -> dict:
    """{'attention': [(b, ctx, s)], 'expert': [(b, s_per_expert)]}: medians over `rounds`.

    Each round visits every point once in a shuffled order (rebuilding its tensors), so slow
    drift of a shared machine spreads over all points instead of biasing some. `copies`
    (default: the model's layer count) is the number of distinct layers rotated through, so the
    working set matches a rank that holds every layer, as the runtime does.
    """
    make_a, make_e = bench_fns(bench)
    copies = copies or shape.num_layers
    points = [("attention", b, c) for c in ctxs for b in batches] + [("expert", b, 0) for b in batches]
    samples = {p: [] for p in points}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = points[:]
        rng.shuffle(order)
        for kind, b, c in order:
            fn = make_a(shape, b, c, dtype, copies) if kind == "attention" else \
                make_e(shape, b, experts, dtype, copies)
            t = time_fn(fn, repeats, warmup=copies, min_time_s=0.002, clock=clock)
            samples[(kind, b, c)].append(t if kind == "attention" else t / experts)
            del fn
    med = {p: statistics.median(v) for p, v in samples.items()}
    return {"attention": [(b, c, med[("attention", b, c)]) for c in ctxs for b in batches],
            "expert": [(b, med[("expert", b, 0)]) for b in batches]}
