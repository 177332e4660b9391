"""MPI side of bench_m2n_ladder.py (run by it under `mpiexec -n 4`; not meant to be run by hand).

Per (M, N) config on a sub-communicator, per size and direction, interleaved in one timing
loop: MPI_Alltoallv, Alltoallv again (the A/A control), bare persistent requests with one
Startall/Testall (mpi-p2p), the channel's pattern in bare mpi4py (lean), the channel's work
written out (inline) and the channel's API (m2n). Also each rank's thread CPU time per op.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from m2n_harness import (BACKOFF, RANK, ROW, WORLD, P2P, alltoallv_op, iters_for,  # noqa: E402
                         mpi_p2p_op, on_sub, timed_many)
from m2n_ladder_ops import inline_op, lean_op  # noqa: E402

from megainfer.comm.mpi import MpiTransport  # noqa: E402

METHODS = ("alltoallv", "alltoallv-again", "mpi-p2p", "lean", "inline", "m2n")


def with_cpu(op, acc: list):
    def run(i):
        t0 = time.thread_time_ns()
        op(i)
        acc.append(time.thread_time_ns() - t0)
    return run


def ops_for(sub, t, s, r, p2p, size, tag, free, pending):
    rows = size // ROW
    return {"alltoallv": alltoallv_op(sub, s, r, size),
            "alltoallv-again": alltoallv_op(sub, s, r, size),
            "mpi-p2p": mpi_p2p_op(sub, s, r, size, free),
            "lean": lean_op(t.comm, s, r, size, tag, free, pending),
            "inline": inline_op(p2p, rows),
            "m2n": p2p.op(rows, BACKOFF)}


def bench_config(sub, M, N, sizes, scale):
    t = MpiTransport(sub)
    A, E = list(range(M)), list(range(M, M + N))
    cap = max(sizes) // ROW
    disp, comb = P2P(t, A, E, cap), P2P(t, E, A, cap)
    rows, free, pending = [], [], []
    for si, size in enumerate(sizes):
        n = iters_for(size * M * N, scale)
        for d, (s, r, p2p, tag) in (("dispatch", (A, E, disp, 1000 + 2 * si)),
                                    ("combine", (E, A, comb, 1001 + 2 * si))):  # lean's tags
            cpu = {k: [] for k in METHODS}
            ops = {k: with_cpu(op, cpu[k])
                   for k, op in ops_for(sub, t, s, r, p2p, size, tag, free, pending).items()}
            got = timed_many(sub, n, ops)
            cpu_med = sub.gather({k: float(np.median(v)) / 1e9 for k, v in cpu.items()}, root=0)
            for q in pending:  # lean's receives posted ahead for an op that will not come
                if not q.Test():
                    q.Cancel()
                    q.Wait()
            pending.clear()
            for k, v in got.items():
                rows.append(dict(M=M, N=N, direction=d, method=k, size=size, iters=len(v),
                                 p50=float(np.median(v)), p99=float(np.percentile(v, 99)),
                                 cpu_max=max(c[k] for c in cpu_med) if cpu_med else None))
    disp.ch.close(), comb.ch.close()
    for q in free:
        q.Free()
    t.close()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="2048,8192,32768,131072")
    ap.add_argument("--configs", default="1x2,2x1,2x2")
    ap.add_argument("--scale", type=float, default=2.0)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    out = []
    for M, N in (tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")):
        rows = on_sub(M + N, lambda sub: bench_config(sub, M, N, sizes, args.scale))
        if RANK == 0:
            out += rows
            print(f"[ladder rank0] {M}x{N} done", flush=True)
    if RANK == 0:
        with open(args.out, "w") as f:
            json.dump({"collectives": out, "methods": METHODS}, f)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # end every rank now rather than leave them in a barrier
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        time.sleep(0.5)  # for mpiexec to forward the traceback before the abort
        WORLD.Abort(1)
