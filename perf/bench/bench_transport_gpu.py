"""Device transports between two processes on one GPU: latency (2 KB) and bandwidth (8 MB).

    python perf/bench/bench_transport_gpu.py [--out perf/results/bench_transport_gpu.json]
      [--mpiexec PATH] [--iters 200] [--sizes 2K,64K,8M]

Launches itself under ``mpiexec -n 2`` (both ranks on GPU 0) and times a ping-pong of one
message each way through megainfer.comm's Channel (reserve + post, then recv + wait, then the
receiving stream synchronised: the bytes are on the device when the clock stops):
  cuda_ipc   CudaIpcTransport: the sender copies into the peer's slot, MPI headers; as ranks
             share the GPU, host-fenced (its ``auto``: headers after the copy completed)
  cuda_ipc_device  the same with device-side waits on the peer's IPC events (sync=device:
             1.34 ms flat per message on the first H200 run, hence host-fenced on a shared GPU)
  mpi        StagingTransport: device -> pinned host -> MPI -> pinned host -> device
  floor      one process, one cudaMemcpy device -> device of the same bytes + synchronise
             (the baseline, measured in the same run by rank 0)
One-way time = round trip / 2 (median and p90 over --iters). Then NCCL with two ranks on the
one GPU is tried (NCCL_MULTI_RANK_GPU_ENABLE=1; NCCL >= 2.30 may allow it) and what happened
is recorded, with a ping-pong if it worked. Last, the TP all-reduce of bf16 [rows, 4096]
(rows 1, 64, 256) both ways a replica can run it: point to point over cuda_ipc
(``comm.tp_collectives=channel``) and MPI through host memory (``mpi``). Targets (issue: cuda_ipc <= 3x the floor at 2 KB,
>= 50% of its bandwidth at 8 MB) are printed beside the table. The JSON is written after each
part, so a timeout keeps what finished.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

from megainfer.bench.results_io import write_json  # noqa: E402
from megainfer.core_client.mpiexec_job import find_mpiexec  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "bench_transport_gpu.json")


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1].upper(), 1)
    return int(s[:-1] if s[-1].upper() in "KM" else s) * mult


def q(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def pingpong(kind: str, comm, size: int, iters: int, dev) -> list[float]:
    """One-way seconds per iteration between ranks 0 and 1 through a Channel over ``kind``."""
    import torch
    from megainfer.comm import Channel, MessageSpec, WaitPolicy
    from megainfer.comm.select import make_device_transports
    if kind == "staging":
        from megainfer.comm.staging import StagingTransport
        t = StagingTransport(comm, dev)
    elif kind == "cuda_ipc_device":
        from megainfer.comm.cuda_ipc import CudaIpcTransport
        t = CudaIpcTransport(comm, dev, sync="device")
    elif kind == "nccl":  # straight to NCCL (select.check_nccl would refuse a shared GPU first)
        from megainfer.comm.nccl import NcclTransport
        t = NcclTransport(comm, dev)
    else:
        t = make_device_transports(kind, comm, dev)[0]
    spec = MessageSpec.of(1, payload=((max(size - 32, 16),), torch.uint8))
    pol = WaitPolicy(mode="spin", timeout_s=60)
    ab = Channel(t, [0], [1], spec, wait=pol, name="ab")
    ba = Channel(t, [1], [0], spec, wait=pol, name="ba")
    me, other = comm.Get_rank(), 1 - comm.Get_rank()
    out = []
    sync = torch.cuda.current_stream(dev).synchronize if dev.type == "cuda" else (lambda: None)
    for i in range(iters + 5):
        comm.Barrier()
        t0 = time.perf_counter()
        if me == 0:
            ab.post(ab.reserve(other, 1), iteration=i, layer=0, micro_batch=0)
            ba.recv(other, layer=0, micro_batch=0).wait().release()
            sync()
        else:
            ab.recv(other, layer=0, micro_batch=0).wait().release()
            ba.post(ba.reserve(other, 1), iteration=i, layer=0, micro_batch=0)
        if i >= 5:
            out.append((time.perf_counter() - t0) / 2)
    for ch in (ab, ba):
        ch.close()
    t.close()
    return out


def floor(size: int, iters: int, dev) -> list[float]:
    import torch
    a = torch.empty(size, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = []
    for i in range(iters + 5):
        sync()
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        if i >= 5:
            out.append(time.perf_counter() - t0)
    return out


def tp_allreduce(kind, comm, rows: int, hidden: int, iters: int, dev) -> list[float]:
    """Seconds per TP all-reduce of bf16 [rows, hidden] between the two ranks: ``mpi`` (the
    host path, runtime.tp_group.TPGroup) or ``channel`` (runtime.tp_channel over cuda_ipc on
    cuda, the MPI transport on cpu); the result is on the device when the clock stops."""
    import torch
    from megainfer.comm import WaitPolicy, make_transports
    from megainfer.runtime.control import ControlPlane
    from megainfer.runtime.tp.channel import TPChannel
    from megainfer.runtime.tp.group import TPGroup
    pol = WaitPolicy(mode="spin", timeout_s=60)
    ctl = ControlPlane(comm, f"[tp{comm.Get_rank()}]", pol)
    ch = t = None
    if kind == "channel":
        t = make_transports("cuda_ipc" if dev.type == "cuda" else "mpi", comm, device=dev)[0]
        ch = TPChannel(t, hidden, torch.bfloat16, rows, pol, [0, 1], ctl.me)
    group = TPGroup(comm, ctl, None, ch)
    x = torch.randn(rows, hidden, device=dev).to(torch.bfloat16)
    sync = torch.cuda.current_stream(dev).synchronize if dev.type == "cuda" else (lambda: None)
    out = []
    for i in range(iters + 5):
        comm.Barrier()
        t0 = time.perf_counter()
        group.all_reduce(x)
        sync()
        if i >= 5:
            out.append(time.perf_counter() - t0)
    if ch is not None:
        ch.close()
        t.close()
    return out


def row(method, size, xs) -> dict:
    med = statistics.median(xs)
    return {"method": method, "bytes": size, "one_way_p50_us": med * 1e6,
            "one_way_p90_us": q(xs, 0.9) * 1e6, "GBps": size / med / 1e9, "iters": len(xs)}


def try_nccl(comm, size: int, iters: int, dev) -> dict:
    os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    rec = {"env": "NCCL_MULTI_RANK_GPU_ENABLE=1"}
    try:
        from megainfer.comm.nccl import nccl_version
        rec["nccl_version"] = nccl_version()
        rec["rows"] = [row("nccl", size, pingpong("nccl", comm, size, iters, dev))]
        rec["result"] = "worked"
    except Exception as e:  # noqa: BLE001 -- what NCCL says is the result
        rec["result"] = f"refused: {type(e).__name__}: {e}"
    return rec


def worker(args) -> None:
    import torch
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    res = {"date": str(datetime.date.today()), "ranks": comm.Get_size(), "rows": [],
           "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (smoke)"}
    kinds = ("cuda_ipc", "cuda_ipc_device", "staging") if dev.type == "cuda" else ("staging",)
    for size in sizes:
        for kind in kinds:
            xs = pingpong(kind, comm, size, args.iters if size < 1 << 20 else args.iters // 4, dev)
            res["rows"].append(row({"staging": "mpi"}.get(kind, kind), size, xs))
        if comm.Get_rank() == 0:
            res["rows"].append(row("floor", size, floor(size, args.iters, dev)))
            write_json(args.out, res, quiet=True)
    res["tp_allreduce"] = []  # bf16 [rows, 4096]: decode micro-batches of a 4096-wide model
    for rows in (1, 64, 256):
        for kind in ("channel", "mpi"):
            xs = tp_allreduce(kind, comm, rows, 4096, args.iters // 2, dev)
            res["tp_allreduce"].append(row(f"tp_{kind}", rows * 4096 * 2, xs) | {"rows": rows})
        if comm.Get_rank() == 0:
            write_json(args.out, res, quiet=True)
    res["nccl_multi_rank"] = (try_nccl(comm, sizes[0], 50, dev) if dev.type == "cuda"
                              else {"result": "not tried (cpu)"})
    if comm.Get_rank() == 0:
        report(res)
        write_json(args.out, res)


def report(res: dict) -> None:
    rows = res["rows"]
    print(f"{'method':>15} {'bytes':>9} {'p50 us':>9} {'p90 us':>9} {'GB/s':>8}")
    for r in rows:
        print(f"{r['method']:>15} {r['bytes']:>9} {r['one_way_p50_us']:>9.1f} "
              f"{r['one_way_p90_us']:>9.1f} {r['GBps']:>8.2f}")
    by = {(r["method"], r["bytes"]): r for r in rows}
    small, big = min(r["bytes"] for r in rows), max(r["bytes"] for r in rows)
    if ("cuda_ipc", small) in by and ("floor", small) in by:
        lat = by[("cuda_ipc", small)]["one_way_p50_us"] / by[("floor", small)]["one_way_p50_us"]
        bw = by[("cuda_ipc", big)]["GBps"] / by[("floor", big)]["GBps"]
        res["targets"] = {"latency_x_floor": lat, "latency_ok": lat <= 3.0,
                          "bandwidth_frac_floor": bw, "bandwidth_ok": bw >= 0.5}
        print(f"cuda_ipc at {small} B: {lat:.2f}x the copy floor (target <= 3x); at {big} B: "
              f"{100 * bw:.0f}% of its bandwidth (target >= 50%)")
    for r in res.get("tp_allreduce", []):  # "one_way" here: one whole all-reduce
        print(f"{r['method']:>15} {r['rows']:>5} rows {r['one_way_p50_us']:>9.1f} us p50 "
              f"{r['one_way_p90_us']:>9.1f} us p90")
    print("NCCL two ranks on one GPU:", res["nccl_multi_rank"].get("result"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--mpiexec", default=find_mpiexec())
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--sizes", default="2K,64K,8M")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the harness (mpi only)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    cmd = [args.mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__), "--worker",
           "--out", args.out, "--iters", str(args.iters), "--sizes", args.sizes,
           "--device", args.device]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode


if __name__ == "__main__":
    sys.exit(main())
