"""Fill the tile-config table of the Triton fused MoE on this GPU (needs CUDA).

For each expert shape (E, N, K) and token-count bucket M it times every config of a small
search space with triton.testing.do_bench (median), checks the winner against the torch
path, and merges the winner into kernels/tile_configs.json under the key
(E, N, K, M bucket, dtype, device name). The table ships with the package; anything missing
falls back to tile_configs.default_config.

  python perf/bench/tune_moe_kernels.py --shape 8,14336,4096 --top-k 2 [--dtype bf16] [--m 1,16,512]
      [--space small|full] [--table PATH] [--log PATH]
Also writes perf/results/tune_moe_kernels.json (--log) with every timing. Both files are
rewritten after every (shape, M), so an interrupted run keeps what it found.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

from megainfer.kernels.tile_configs import (M_BUCKETS, TABLE_PATH, default_config, device_name,
                                             table_key)
from megainfer.kernels.torch_moe import fused_moe_torch

from bench_moe_kernels import balanced_routing  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def search_space(per_expert: float, space: str = "full"):
    """Decode-like (<= 32 slots per expert) or prefill-like configs: 54 / 144 in the full
    space, 12 / 16 in the small one (each config is a Triton compile, ~1-3 s)."""
    decode = per_expert <= 32
    if space == "small":
        grid = (itertools.product((16,), (64, 128), (64, 128, 256), (1,), (4,), (3, 4)) if decode
                else itertools.product((64, 128), (128, 256), (64,), (8,), (4, 8), (3, 4)))
    elif decode:
        grid = itertools.product((16, 32), (32, 64, 128), (64, 128, 256), (1,), (4,), (2, 3, 4))
    else:
        grid = itertools.product((64, 128), (64, 128, 256), (32, 64, 128), (1, 8), (4, 8), (3, 4))
    for bm, bn, bk, gm, warps, stages in grid:
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps,
                   num_stages=stages)


def tune_one(E, N, K, M, top_k, dtype, log, space):
    import triton
    from megainfer.kernels.triton_moe import fused_moe_triton
    dev = "cuda"
    hidden = torch.randn(M, K, device=dev).to(dtype)
    w1 = (torch.randn(E, 2 * N, K, device=dev) / K ** 0.5).to(dtype)
    w2 = (torch.randn(E, K, N, device=dev) / N ** 0.5).to(dtype)
    w, ids = balanced_routing(M, E, top_k, dev)  # as bench_moe_kernels times it (EPLB's aim)
    best, best_ms = None, float("inf")
    dflt = default_config(E, M, top_k)  # a candidate too: an entry must beat it
    cands = [dflt] + [c for c in search_space(M * top_k / E, space) if c != dflt]
    for cfg in cands:
        try:
            ms = triton.testing.do_bench(
                lambda: fused_moe_triton(hidden, w1, w2, w, ids, config=cfg), return_mode="median")
        except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: skip the config
            log.append(dict(E=E, N=N, K=K, M=M, config=cfg, error=str(exc)[:120]))
            continue
        log.append(dict(E=E, N=N, K=K, M=M, config=cfg, ms=ms))
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"no config ran for E={E} N={N} K={K} M={M}")
    got = fused_moe_triton(hidden, w1, w2, w, ids, config=best).float()
    ref = fused_moe_torch(hidden, w1, w2, w, ids).float()
    err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    if err > 5e-2:
        raise RuntimeError(f"best config {best} is wrong: relative error {err:.3g}")
    return best, best_ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", required=True, help="E,N,K (repeatable)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--m", default=",".join(map(str, M_BUCKETS)), help="token counts")
    ap.add_argument("--table", default=str(TABLE_PATH))
    ap.add_argument("--space", choices=("small", "full"), default="full")
    ap.add_argument("--log", default=str(RESULTS / "tune_moe_kernels.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tune_moe_kernels: needs a CUDA GPU (Triton compiles for the device); "
                 "nothing was written")
    dtype, dev_name = DTYPES[args.dtype], device_name(torch.device("cuda"))
    table_path, log_path = Path(args.table), Path(args.log)
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log, best = [], []
    for shape in args.shape:
        E, N, K = (int(x) for x in shape.split(","))
        for M in (int(x) for x in args.m.split(",")):
            cfg, ms = tune_one(E, N, K, M, args.top_k, dtype, log, args.space)
            table[table_key(E, N, K, M, dtype, dev_name)] = cfg
            best.append(dict(E=E, N=N, K=K, M=M, top_k=args.top_k, ms=ms, config=cfg))
            print(f"[tune] E={E} N={N} K={K} M={M}: {ms:.3f} ms {cfg}")
            # after every (shape, M): an interrupted run keeps what it found
            table_path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
            log_path.write_text(json.dumps(dict(
                date=datetime.datetime.now().isoformat(timespec="seconds"), device=dev_name,
                dtype=args.dtype, top_k=args.top_k, space=args.space, best=best,
                timings=log), indent=1))
    print(f"[tune] wrote {table_path} and {log_path}")


if __name__ == "__main__":
    main()
