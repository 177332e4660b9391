"""FP8 block-scaled GEMMs against bf16, side by side in one run, on the GPU.

    python perf/bench/bench_fp8_gemm_gpu.py [--device cuda] [--budget-s 200] [--out FILE]
    TRITON_INTERPRET=1 python perf/bench/bench_fp8_gemm_gpu.py --device cpu --smoke   # seconds

Grouped (the MoE experts, ``triton_moe.fused_moe_triton``): fp8 weights (e4m3, 128 x 128 block
scales, activations per token per 128-group, dequantised in the tile) vs the same kernel on bf16
weights, at the expert shapes of Mixtral-8x7B (E 8, top 2, N 14336, K 4096), Qwen3-30B-A3B
(128, 8, 768, 2048) and DeepSeek-V3 (256, 8, 2048, 7168): decode B = 1, 8, 32, 64, 128, 256
and a prefill of 4096 tokens. Routing: uniform random top-k (seeded).
Dense (``triton_fp8_gemm.fp8_block_linear``: activation quantiser + w8a8 block GEMM on the
fp8 tensor cores) vs ``F.linear`` in bf16, at DeepSeek-V3's q_b / o projections and the
Mixtral / Qwen3 qkv projections, M as above.

Timing: ``triton.testing.do_bench`` (CUDA events, L2 flushed, median). Floors in the same run:
HBM, the weight bytes a call reads (experts the batch touches; scales included) over the copy
bandwidth (a 1 GiB device copy, 2N / t, as bench_gpu_engine.py); compute, the call's FLOPs over
the profile's dense peak (conf/hardware/h200.yaml: bf16 989, fp8 1979 TFLOP/s). Rows go to the
JSON (default perf/results/bench_fp8_gemm_<device>.json) as each one finishes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megainfer.kernels.triton_fp8_gemm import fp8_block_linear
from megainfer.kernels.triton_moe import fused_moe_triton
from megainfer.kernels.weight_quant import QuantizedWeight, WeightFormat, quantize

RESULTS = Path(__file__).resolve().parents[1] / "results"
PEAK = {"bfloat16": 989.4e12, "fp8": 1978.9e12}  # conf/hardware/h200.yaml, dense
EXPERTS = {"mixtral_8x7b": (8, 2, 14336, 4096), "qwen3_30b_a3b": (128, 8, 768, 2048),
           "deepseek_v3": (256, 8, 2048, 7168)}
DENSE = {"deepseek_v3.q_b": (24576, 1536), "deepseek_v3.o": (7168, 16384),
         "mixtral_8x7b.qkv": (6144, 4096), "qwen3_30b_a3b.qkv": (5120, 2048)}
BATCHES = (1, 8, 32, 64, 128, 256, 4096)
SMOKE = dict(experts={"tiny": (4, 2, 64, 64)}, dense={"tiny": (64, 64)}, batches=(1, 4),
             block=(32, 32))


def timer(device):
    if device == "cuda":
        import triton
        return lambda fn: triton.testing.do_bench(fn, return_mode="median") / 1e3
    def cpu(fn):
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return cpu


def copy_bw(device, tm) -> float:
    n = (1 << 30) if device == "cuda" else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / tm(lambda: dst.copy_(src))


def _fp8(w: torch.Tensor, fmt: WeightFormat) -> QuantizedWeight:
    """Stacked [E, N, K] bf16 -> fp8, one expert at a time (no full fp32 copy)."""
    parts = [quantize(w[e], fmt) for e in range(w.shape[0])] if w.dim() == 3 else [quantize(w, fmt)]
    data = torch.stack([p[0] for p in parts]) if w.dim() == 3 else parts[0][0]
    scale = torch.stack([p[1] for p in parts]) if w.dim() == 3 else parts[0][1]
    return QuantizedWeight(data, scale, fmt, tuple(w.shape))


def _randn(shape, device, g) -> torch.Tensor:
    return (torch.randn(shape, device=device, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)


def grouped_rows(name, shape, batches, fmt, device, tm, bw, emit, over):
    E, k, N, K = shape
    g = torch.Generator(device=device).manual_seed(0)
    w1 = torch.stack([_randn((2 * N, K), device, g) for _ in range(E)])
    w2 = torch.stack([_randn((K, N), device, g) for _ in range(E)])
    q1, q2 = _fp8(w1, fmt), _fp8(w2, fmt)
    fp8_b = (q1.data.numel() + q2.data.numel() + 4 * (q1.scale.numel() + q2.scale.numel())) / E
    for B in batches:
        if over():
            return
        x = torch.randn(B, K, device=device, generator=g).to(torch.bfloat16)
        ids = torch.rand(B, E, device=device, generator=g).argsort(-1)[:, :k].to(torch.int32)
        tw = torch.softmax(torch.randn(B, k, device=device, generator=g), -1)
        active = int(torch.unique(ids).numel())
        t16 = tm(lambda: fused_moe_triton(x, w1, w2, tw, ids))
        t8 = tm(lambda: fused_moe_triton(x, q1, q2, tw, ids))
        flops = 2 * B * k * 3 * N * K
        row = dict(kind="grouped", model=name, E=E, top_k=k, N=N, K=K, batch=B,
                   active_experts=active, bf16_s=t16, fp8_s=t8, speedup=t16 / t8,
                   hbm_frac_bf16=active * 3 * N * K * 2 / bw / t16,
                   hbm_frac_fp8=active * fp8_b / bw / t8,
                   tflops_bf16=flops / t16 / 1e12, tflops_fp8=flops / t8 / 1e12,
                   peak_frac_bf16=flops / t16 / PEAK["bfloat16"],
                   peak_frac_fp8=flops / t8 / PEAK["fp8"])
        emit(row)


def dense_rows(name, shape, batches, fmt, device, tm, bw, emit, over):
    N, K = shape
    g = torch.Generator(device=device).manual_seed(1)
    w = _randn((N, K), device, g)
    qw = _fp8(w, fmt)
    fp8_b = qw.data.numel() + 4 * qw.scale.numel()
    for M in batches:
        if over():
            return
        x = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16)
        t16 = tm(lambda: F.linear(x, w))
        t8 = tm(lambda: fp8_block_linear(x, qw))
        err = (fp8_block_linear(x, qw).float() - F.linear(x, w).float()).abs().max().item()
        flops = 2 * M * N * K
        emit(dict(kind="dense", weight=name, N=N, K=K, batch=M, bf16_s=t16, fp8_s=t8,
                  speedup=t16 / t8, hbm_frac_bf16=N * K * 2 / bw / t16,
                  hbm_frac_fp8=fp8_b / bw / t8, tflops_fp8=flops / t8 / 1e12,
                  peak_frac_fp8=flops / t8 / PEAK["fp8"], max_abs_err_vs_bf16=err))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the interpreter)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = a.device
    experts, dense, batches = EXPERTS, DENSE, BATCHES
    fmt = WeightFormat("fp8")
    if a.smoke:
        experts, dense, batches = SMOKE["experts"], SMOKE["dense"], SMOKE["batches"]
        fmt = WeightFormat("fp8", block=SMOKE["block"])
    out = Path(a.out or RESULTS / f"bench_fp8_gemm_{dev}.json")
    t0, tm = time.time(), timer(dev)
    bw = copy_bw(dev, tm)
    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=dev,
               gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu", copy_bw_rw=bw,
               torch=torch.__version__, smoke=a.smoke, rows=[])

    def emit(row):
        res["rows"].append(row)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)

    def over() -> bool:
        return time.time() - t0 > a.budget_s
    for name, shape in experts.items():
        grouped_rows(name, shape, batches, fmt, dev, tm, bw, emit, over)
        if dev == "cuda":
            torch.cuda.empty_cache()
    for name, shape in dense.items():
        dense_rows(name, shape, batches, fmt, dev, tm, bw, emit, over)
    res["complete"] = not over()
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out} ({len(res['rows'])} rows, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
