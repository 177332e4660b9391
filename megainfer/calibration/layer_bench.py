"""Per-layer attention and expert timings at given batch sizes (the calibration's raw data).

A bench is a pair of builders, each returning a zero-argument callable that runs one layer once:
  make_attention(shape, b, ctx, dtype, copies) -> fn  # one decode micro-batch, b tokens, KV ctx
  make_experts(shape, b, experts, dtype, copies) -> fn # `experts` local experts, b tokens each
Each builder rotates over `copies` distinct layers (weights, KV cache), by default the model's
layer count, so the working set is a real rank's: timing one hot copy would measure the cache.
The benches (``BENCHES``): "torch_ops" times plain-torch ops at the model's shapes
(torch_ops_bench); "megainfer" and "megainfer_cuda" time the project's own modules (module_bench).
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Callable

from megainfer.config import ConfigError
from megainfer.perfmodel.model.shapes import ModelShape

from .module_bench import module_attention, module_experts
from .torch_ops_bench import torch_attention, torch_experts

# name -> (make_attention, make_experts): the plain-torch ops, the project's own modules on the
# CPU, and the same modules on the current GPU (wall clock, bf16)
BENCHES = {
    "torch_ops": (torch_attention, torch_experts),
    "megainfer": (module_attention, module_experts),
    "megainfer_cuda": (lambda *a, **k: module_attention(*a, **k, device="cuda"),
                       lambda *a, **k: module_experts(*a, **k, device="cuda")),
}


def register_bench(name: str, make_attention, make_experts) -> None:
    BENCHES[name] = (make_attention, make_experts)


def bench_fns(name: str) -> tuple:
    """(make_attention, make_experts) of a bench."""
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
