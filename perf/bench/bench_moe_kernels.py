"""Benchmark the MoE expert FFN kernels against named baselines, side by side in one run.

CPU (default when no GPU): the vectorised torch path (megainfer.kernels.fused_moe) vs a naive
per-expert Python loop (HF transformers style) vs DeepSpeed's MoE layer (the `deepspeed`
extra; reported unavailable, with the reason, when it cannot run). Rates are set against
this machine's dense fp32 matmul rate (torch.mm, square) and memory copy bandwidth, both
measured in the same run.
GPU: Triton (tile-config table entry, and the default config where the table has one) vs the
torch path in bf16, timed with triton.testing.do_bench (CUDA events, median), against the
measured dense bf16 matmul rate and copy bandwidth.

  python perf/bench/bench_moe_kernels.py [--device cpu|cuda] [--repeats 7] [--threads 1] [--quick]
Writes perf/results/bench_moe_kernels_<device>[_t<threads>].json. On CPU the default is one torch
thread: on a machine shared with other jobs, multi-threaded MKL/OpenMP stragglers swamp the
signal (see docs/kernels.md); the matmul and copy references run with the same threads.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megainfer.kernels import fused_moe, select_experts

RESULTS = Path(__file__).resolve().parents[1] / "results"


def timeit(fn, repeats: int, sync) -> list[float]:
    fn()  # warm-up
    sync()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t)
    return samples


def machine_rates(device, dtype, repeats, sync) -> dict:
    """Dense square matmul rate (FLOP/s) and copy bandwidth (bytes read + written per s)."""
    n = 2048 if device == "cpu" else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    tm = gpu_time if device != "cpu" else (lambda fn: timeit(fn, repeats, sync))
    mm = tm(lambda: torch.mm(a, b))
    nbytes = 64 * 2 ** 20 if device == "cpu" else 2 ** 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    cp = tm(lambda: dst.copy_(src))
    return dict(matmul_n=n, matmul_flops=2 * n ** 3 / statistics.median(mm),
                copy_bytes=src.numel(), copy_bw=2 * src.numel() / statistics.median(cp),
                matmul_samples=mm, copy_samples=cp)


def balanced_routing(M, E, k, device):
    """Token m -> experts (m*k + j) % E: exactly M*k/E slots per expert, k distinct experts."""
    ids = (torch.arange(M * k, device=device) % E).view(M, k)  # [M, k]
    ids = ids[torch.randperm(M, device=device)]
    w = torch.softmax(torch.randn(M, k, device=device), dim=-1)  # [M, k] fp32
    return w, ids


def naive_loop(hidden, w1, w2, w, ids):
    """Per-expert Python loop, HF transformers style: where, gather, 2 matmuls, index_add."""
    N = w2.shape[2]
    out = torch.zeros_like(hidden)
    for e in range(w1.shape[0]):
        tok, j = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        gu = F.linear(hidden[tok], w1[e])  # [n, 2N]
        y = F.linear(F.silu(gu[:, :N]) * gu[:, N:], w2[e])  # [n, K]
        out.index_add_(0, tok, y * w[tok, j, None].to(y.dtype))
    return out


def deepspeed_layer(w1, w2, k):
    """DeepSpeed's MoE layer with our expert weights, on one gloo rank. Returns (layer, why).
    Top-2 gating without DeepSpeed's default random 2nd-expert sampling, no token dropping."""
    try:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        for var, val in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(var, val)
        import deepspeed
        from deepspeed.moe.layer import MoE
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    except Exception as exc:  # noqa: BLE001 - an optional baseline: report why it is missing
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    E, N2, K = w1.shape
    N = N2 // 2

    class Expert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = torch.nn.Linear(K, N2, bias=False)
            self.down = torch.nn.Linear(N, K, bias=False)

        def forward(self, x):
            gu = self.gate_up(x)
            return self.down(F.silu(gu[..., :N]) * gu[..., N:])

    layer = MoE(hidden_size=K, expert=Expert(), num_experts=E, ep_size=1, k=k,
                capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0,
                drop_tokens=False, top2_2nd_expert_sampling=False).eval()
    with torch.no_grad():
        for e, ex in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            ex.gate_up.weight.copy_(w1[e])
            ex.down.weight.copy_(w2[e])
    return layer, None


def interleaved(variants: dict, repeats: int, sync) -> dict:
    """Time each variant once per round, round-robin, so machine load hits them alike."""
    for fn in variants.values():
        fn()  # warm-up
    sync()
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - t)
    return samples


@torch.no_grad()
def deepspeed_check(layer, hidden, w1, w2, k) -> dict:
    """DeepSpeed routes with its own gate: redo its routing with select_experts and our kernel
    to show it computes the same function, and record how unbalanced its routing is."""
    M, K = hidden.shape
    y = layer(hidden.view(1, M, K))[0].view(M, K)
    w, ids = select_experts(layer.deepspeed_moe.gate.wg(hidden), k, renormalize=True)
    counts = torch.bincount(ids.flatten(), minlength=w1.shape[0])
    diff = (y - fused_moe(hidden, w1, w2, w, ids)).abs().max().item()
    return dict(max_abs_diff_vs_torch_path=diff, ds_routing_max_per_expert=int(counts.max()),
                ds_routing_experts_hit=int((counts > 0).sum()))


def cpu_rows(w1, w2, k, per_expert, repeats, ds_layer, ds_why):
    """One shape: torch path, naive loop, DeepSpeed and the dense-matmul / copy references,
    interleaved; the percentages use this group's own reference medians."""
    E, N2, K = w1.shape
    N = N2 // 2
    M = per_expert * E // k
    g = torch.Generator().manual_seed(per_expert)
    hidden = torch.randn(M, K, generator=g)
    w, ids = balanced_routing(M, E, k, "cpu")
    flops = 6 * K * N * M * k  # 2*K*2N + 2*N*K per slot
    weight_bytes = E * 3 * K * N * 4  # balanced routing hits every expert
    check = dict(max_abs_diff_vs_naive=(fused_moe(hidden, w1, w2, w, ids) -
                                        naive_loop(hidden, w1, w2, w, ids)).abs().max().item())
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    src = torch.empty(64 * 2 ** 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    variants = {"torch path": lambda: fused_moe(hidden, w1, w2, w, ids),
                "naive loop": lambda: naive_loop(hidden, w1, w2, w, ids),
                "_mm": lambda: torch.mm(a, b), "_copy": lambda: dst.copy_(src)}
    if ds_layer is not None:
        x = hidden.view(1, M, K)
        variants["deepspeed MoE"] = lambda: ds_layer(x)[0]
        ds_check = deepspeed_check(ds_layer, hidden, w1, w2, k)
    with torch.no_grad():
        samples = interleaved(variants, repeats, lambda: None)
    mm_rate = 2 * 2048 ** 3 / statistics.median(samples.pop("_mm"))
    copy_bw = 2 * src.numel() / statistics.median(samples.pop("_copy"))
    rows = []
    for name, smp in samples.items():
        t = statistics.median(smp)
        rows.append(dict(impl=name, E=E, k=k, K=K, N=N, M=M, per_expert=per_expert,
                         median_s=t, tokens_per_s=M / t, gflops=flops / t / 1e9,
                         pct_matmul=100 * flops / t / mm_rate, weight_gbps=weight_bytes / t / 1e9,
                         pct_copy_bw=100 * weight_bytes / t / copy_bw, samples=smp,
                         group_matmul_flops=mm_rate, group_copy_bw=copy_bw,
                         **(check if name == "torch path" else {}),
                         **(ds_check if name == "deepspeed MoE" else {})))
    if ds_layer is None:
        rows.append(dict(impl="deepspeed MoE", E=E, k=k, K=K, N=N, M=M, per_expert=per_expert,
                         unavailable=ds_why))
    return rows


def gpu_time(fn) -> list[float]:
    """Seconds per call: triton.testing.do_bench (CUDA events, L2 flushed before each call,
    ~100 ms of calls after a warm-up), every sample."""
    import triton
    return [ms / 1e3 for ms in triton.testing.do_bench(fn, return_mode="all")]


def gpu_rows(E, k, K, N, per_expert, rates):
    """Triton (the tile-config table's entry, else the default) vs the torch path, plus the
    default config when the table has a tuned one (what tuning bought), bf16."""
    from megainfer.kernels.tile_configs import default_config, get_config
    from megainfer.kernels.torch_moe import fused_moe_torch
    from megainfer.kernels.triton_moe import fused_moe_triton
    M = max(1, per_expert * E // k)
    dev, dt = "cuda", torch.bfloat16
    hidden = torch.randn(M, K, device=dev, dtype=dt)
    w1 = (torch.randn(E, 2 * N, K, device=dev) / K ** 0.5).to(dt)
    w2 = (torch.randn(E, K, N, device=dev) / N ** 0.5).to(dt)
    w, ids = balanced_routing(M, E, k, dev)
    flops = 6 * K * N * M * k
    weight_bytes = min(E, M * k) * 3 * K * N * 2
    ref = fused_moe_torch(hidden, w1, w2, w, ids).float()
    cfg = get_config(E, N, K, M, k, dt, torch.device(dev))
    dflt = default_config(E, M, k)
    variants = {"triton": (cfg, lambda: fused_moe_triton(hidden, w1, w2, w, ids)),
                "torch path": (None, lambda: fused_moe_torch(hidden, w1, w2, w, ids))}
    if cfg != dflt:
        variants["triton default"] = (dflt, lambda: fused_moe_triton(hidden, w1, w2, w, ids,
                                                                     config=dflt))
    rows = []
    for name, (config, fn) in variants.items():
        rel = ((fn().float() - ref).norm() / ref.norm()).item()
        s = gpu_time(fn)
        t = statistics.median(s)
        rows.append(dict(impl=name, E=E, k=k, K=K, N=N, M=M, per_expert=per_expert, median_s=t,
                         tokens_per_s=M / t, tflops=flops / t / 1e12,
                         pct_matmul=100 * flops / t / rates["matmul_flops"],
                         weight_gbps=weight_bytes / t / 1e9,
                         pct_copy_bw=100 * weight_bytes / t / rates["copy_bw"],
                         n_samples=len(s), p10_s=sorted(s)[len(s) // 10],
                         rel_err_vs_torch=rel, config=config))
    return rows


def print_table(rows, gpu):
    rate = "TFLOP/s" if gpu else "GFLOP/s"
    print(f"{'impl':<15}{'E':>4}{'k':>3}{'K':>6}{'N':>6}{'M':>6}{'M/exp':>7}{'ms':>10}"
          f"{'tok/s':>11}{rate:>9}{'%mm':>6}{'wGB/s':>8}{'%copy':>7}")
    for r in rows:
        head = (f"{r['impl']:<15}{r['E']:>4}{r['k']:>3}{r['K']:>6}{r['N']:>6}{r['M']:>6}"
                f"{r['per_expert']:>7}")
        if "unavailable" in r:
            print(head + f"   unavailable: {r['unavailable']}")
            continue
        fl = r["tflops"] if gpu else r["gflops"]
        print(head + f"{1e3 * r['median_s']:>10.2f}{r['tokens_per_s']:>11.0f}{fl:>9.1f}"
              f"{r['pct_matmul']:>6.0f}{r['weight_gbps']:>8.1f}{r['pct_copy_bw']:>7.0f}")


def gpu_requested(device: str) -> bool:
    return device.startswith("cuda")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (0: torch default); 1 keeps a shared machine fair")
    args = ap.parse_args(argv)
    if args.threads and not gpu_requested(args.device):
        torch.set_num_threads(args.threads)
    gpu = args.device == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    rates = machine_rates(args.device, torch.bfloat16 if gpu else torch.float32,
                          args.repeats, sync)
    unit = 1e12 if gpu else 1e9
    print(f"[bench] {platform.platform()} cpus={os.cpu_count()} threads={torch.get_num_threads()}"
          f" load={os.getloadavg()}")
    print(f"[bench] dense {'bf16' if gpu else 'fp32'} matmul {rates['matmul_n']}^2: "
          f"{rates['matmul_flops'] / unit:.1f} {'T' if gpu else 'G'}FLOP/s; "
          f"copy bandwidth (read+write): {rates['copy_bw'] / 1e9:.1f} GB/s")
    rows = []
    tag = ("_quick" if args.quick else "") + (f"_t{args.threads}" if not gpu else "")
    out = RESULTS / f"bench_moe_kernels_{args.device}{tag}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)

    def save():  # after every shape: a crash keeps what finished
        out.write_text(json.dumps(dict(
            date=datetime.datetime.now().isoformat(timespec="seconds"),
            machine=dict(platform=platform.platform(), processor=platform.processor(),
                         cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                         loadavg=os.getloadavg(), torch=torch.__version__,
                         triton=_triton_version(),
                         gpu=torch.cuda.get_device_name() if gpu else None),
            rates=rates, rows=rows, argv=sys.argv[1:]), indent=1))
    if gpu:
        shapes = [(8, 2, 4096, 14336), (64, 6, 2048, 1408)]  # Mixtral-8x7B, DeepSeek-V2-Lite
        shapes = [(8, 2, 256, 512)] if args.quick else shapes
        for E, k, K, N in shapes:
            for pe in (1, 8, 64, 512, 2048):
                rows += gpu_rows(E, k, K, N, pe, rates)
                save()
    else:
        E, k, K, N = (8, 2, 1024, 1024) if not args.quick else (4, 2, 128, 128)
        g = torch.Generator().manual_seed(0)
        w1 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5  # [E, 2N, K]
        w2 = torch.randn(E, K, N, generator=g) / N ** 0.5  # [E, K, N]
        ds_layer, ds_why = None, "skipped (--no-deepspeed)"
        if not args.no_deepspeed:
            ds_layer, ds_why = deepspeed_layer(w1, w2, k)
        for pe in (1, 4, 8, 32, 256, 512):
            rows += cpu_rows(w1, w2, k, pe, args.repeats, ds_layer, ds_why)
            save()
    print_table(rows, gpu)
    print(f"[bench] wrote {out}")


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
