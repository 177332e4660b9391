"""Calibration: measure this machine and write a hardware profile (YAML) with layer fits.

Measures, with torch pinned to ``threads`` threads (one MPI rank's share of the cores):
fp32 matmul FLOP/s, memcpy bandwidth, MPI one-way latency/bandwidth over message sizes
(mpiexec -n 2 of megainfer.calibration.mpi_pingpong), and per-layer attention / expert times
at several batch sizes, fitted to T_a = k2 + b (k1 + k1_ctx ctx), T_e = k3 b + k4; and what
ranks sharing this node cost each other (``node_bench``: cores, kernel slowdown when two
processes compute at once, host overhead per (layer, micro-batch), wake-up latency of a wait).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch
import yaml

from megainfer.config import ConfigError
from megainfer.perfmodel.model.fit import fit_attention, fit_line
from megainfer.calibration.layer_bench import measure_layers, time_fn
from megainfer.calibration.node_bench import measure_node
from megainfer.perfmodel.model.shapes import ModelShape


def matmul_flops(n: int = 512, dtype=torch.float32, device: str = "cpu") -> float:
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    t = time_fn(_synced(lambda: a @ b, device), repeats=5, min_time_s=0.05, clock=_clock(device))
    return 2 * n ** 3 / t


def memcpy_bandwidth(nbytes: int = 64 << 20, device: str = "cpu") -> float:
    """Bytes moved (read + write) per second by a large tensor copy."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = time_fn(_synced(lambda: dst.copy_(src), device), repeats=5, min_time_s=0.05,
                clock=_clock(device))
    return 2 * nbytes / t


def _clock(device: str) -> str:
    return "wall" if device == "cuda" else "thread"


def _synced(fn, device: str):
    if device != "cuda":
        return fn
    return lambda: (fn(), torch.cuda.synchronize())


def transport_link(path: str) -> dict:
    """intra_link from perf/bench/bench_transport_gpu.py's JSON (``$MEGAINFER_CALIBRATE_LINK``):
    the cuda_ipc rows' one-way times fitted like an MPI ping-pong."""
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["method"] == "cuda_ipc"]
    if not rows:
        raise ConfigError(f"{path}: no cuda_ipc rows to calibrate the link from")
    return fit_link(sorted(({"bytes": r["bytes"], "one_way_s": r["one_way_p50_us"] / 1e6}
                            for r in rows), key=lambda p: p["bytes"]))


def mpiexec_path() -> str:
    from megainfer.core_client.mpiexec_job import find_mpiexec
    from megainfer.engine.failures import CoreStartError
    try:
        return find_mpiexec()
    except CoreStartError as e:
        raise ConfigError(f"calibrate: {e}") from e


def mpi_pingpong(max_bytes: int = 1 << 24, repeats: int = 20, timeout_s: float = 300) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "pp.json")
        cmd = [mpiexec_path(), "-n", "2", sys.executable, "-m", "megainfer.calibration.mpi_pingpong",
               out, str(max_bytes), str(repeats)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode or not os.path.isfile(out):
            raise RuntimeError(f"calibrate: MPI ping-pong failed (rc={r.returncode}): {r.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["results"]


def fit_link(points: list[dict]) -> dict:
    """Latency = smallest message's one-way time; bandwidth = slope over messages >= 64 KiB;
    curve = achieved / peak bandwidth per size."""
    lat = points[0]["one_way_s"]
    big = [p for p in points if p["bytes"] >= 64 << 10] or points[-2:]
    k, _ = fit_line([p["bytes"] for p in big], [p["one_way_s"] for p in big])
    bw = 1.0 / k if k > 0 else big[-1]["bytes"] / big[-1]["one_way_s"]
    curve = []
    for p in points:
        dt = p["one_way_s"] - lat
        util = 1.0 if dt <= 0 else min(1.0, p["bytes"] / dt / bw)
        curve.append([p["bytes"], round(max(util, 1e-4), 5)])
    return {"latency_s": lat, "bandwidth_Bps": bw, "curve": curve}


def calibrate(shape: ModelShape, threads: int = 1, smoke: bool = False, bench: str = "torch_ops",
              experts: int = 0, price_per_hour: float = 0.10, mpi: bool = True,
              clock: str = "thread", node: bool = True) -> dict:
    """Returns the profile as a dict (profile_from_dict reads it; write_profile saves it)."""
    torch.set_num_threads(threads)
    device = "cuda" if bench.endswith("_cuda") else "cpu"  # GPU benches: wall clock, bf16
    dtype = "bfloat16" if device == "cuda" else "float32"
    if device == "cuda":
        clock = "wall"
    # cover the decode operating range (batches of hundreds, short and long contexts): the
    # runtime validation predicts b = 96..288 at ctx ~ 20, which a fit ending at 64 / 128 misses
    batches = (1, 2, 4) if smoke else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    ctxs = (16, 32) if smoke else (32, 128, 512)
    experts = experts or max(1, shape.num_experts // 2)
    layers = measure_layers(shape, batches, ctxs, experts, bench, dtype=dtype,
                            rounds=1 if smoke else 5, repeats=1 if smoke else 3, clock=clock)
    k1, k1c, k2 = fit_attention(*zip(*layers["attention"]), relative=True)
    k3, k4 = fit_line(*zip(*layers["expert"]), relative=True)
    link = fit_link(mpi_pingpong(1 << 16 if smoke else 1 << 24, 3 if smoke else 20)) if mpi else \
        {"latency_s": 5e-6, "bandwidth_Bps": 5e9}
    if os.environ.get("MEGAINFER_CALIBRATE_LINK"):
        link = transport_link(os.environ["MEGAINFER_CALIBRATE_LINK"])
    mem = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else \
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    node_d = measure_node(shape, bench, experts, smoke) if node else {"cores": os.cpu_count() or 1}
    node_raw = node_d.pop("raw", {})
    where = (f"{torch.cuda.get_device_name()}, " if device == "cuda" else "") + \
        f"{platform.processor() or platform.machine()}"
    return {
        "name": f"{device}_{platform.node() or 'node'}",
        "source": (f"measured by megainfer-plan calibrate on {datetime.date.today()}, "
                   f"{where}, {os.cpu_count()} cores, "
                   f"torch threads={threads}, bench={bench}, clock={clock}; the machine was "
                   f"shared (load average {os.getloadavg()[0]:.1f})"),
        "matmul_flops": {"float32": matmul_flops(256 if smoke else 512, device=device),
                         **({"bfloat16": matmul_flops(4096, torch.bfloat16, device)}
                            if device == "cuda" else {})},
        "mem_bw_Bps": memcpy_bandwidth(8 << 20 if smoke else 64 << 20, device),
        "mem_bytes": float(mem),
        "intra_link": dict(link), "inter_link": dict(link),
        "price_per_hour": price_per_hour,
        "matmul_efficiency": 1.0, "mem_efficiency": 1.0,  # measured rates are already achieved
        "kernel_overhead_s": max(k4, 0.0), "mem_util": 0.5,  # ranks share the node's memory
        "node": node_d,
        "fits": {shape.name: {"k1": k1, "k2": k2, "k3": k3, "k4": k4, "k1_ctx": k1c,
                              "ctx_ref": int(ctxs[-1]), "dtype": dtype}},
        "calibration": {"threads": threads, "experts_per_rank": experts, "batches": list(batches),
                        "attention": [list(x) for x in layers["attention"]],
                        "expert": [list(x) for x in layers["expert"]], "node": node_raw},
    }


def merge_profile(profile: dict, path: str) -> dict:
    """Keep the fits of other models already in ``path`` (a profile calibrated per model)."""
    if not os.path.isfile(path):
        return profile
    with open(path) as f:
        old = yaml.safe_load(f) or {}
    out = dict(profile)
    out["fits"] = {**(old.get("fits") or {}), **profile["fits"]}
    if old.get("calibration_notes"):
        out["calibration_notes"] = old["calibration_notes"]
    return out


def remeasure_node(path: str, shape: ModelShape, bench: str = "torch_ops", threads: int = 1,
                   smoke: bool = False) -> dict:
    """The profile at ``path`` with its ``node:`` section measured again (the rest unchanged)."""
    if not os.path.isfile(path):
        raise ConfigError(f"calibrate.out={path!r}: calibrate.node_only needs an existing profile")
    with open(path) as f:
        prof = yaml.safe_load(f) or {}
    torch.set_num_threads(threads)
    node = measure_node(shape, bench, max(1, shape.num_experts // 2), smoke)
    prof.setdefault("calibration", {})["node"] = node.pop("raw")
    prof["node"] = node
    notes = [n for n in prof.get("calibration_notes") or [] if not str(n).startswith("node:")]
    prof["calibration_notes"] = notes + [
        f"node: measured by megainfer-plan calibrate calibrate.node_only=true on {datetime.date.today()} "
        f"(model={shape.name}, bench={bench}, load average {os.getloadavg()[0]:.1f})"]
    return prof


def write_profile(profile: dict, path: str) -> None:
    with open(path, "w") as f:
        f.write("# Calibrated CPU profile written by `megainfer-plan calibrate` "
                "(see docs/perfmodel.md).\n")
        yaml.dump(profile, f, Dumper=_NoAlias, sort_keys=False)


class _NoAlias(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True
