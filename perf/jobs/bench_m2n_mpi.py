"""MPI side of bench_m2n.py (run by it under `mpiexec -n 4`; not meant to be run by hand).

Every (M, N) config runs on a sub-communicator of the first M+N ranks while the rest sleep.
Per message size: M2N dispatch and N2M combine through megainfer.comm (zero-copy reserve
path, pre-posted receives), the same traffic through MPI_Alltoallv, through mpi4py persistent
requests (the floor of a Python p2p layer) and through gloo all_to_all_single.
Then raw MPI ping-pong vs channel ping-pong (1x1), compute overlap (1x2), and the
wait-policy contention test (3 ranks on 2 cores).
"""
import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from megainfer.comm import Channel, MessageSpec
from megainfer.comm.mpi import MpiTransport

from m2n_harness import (BACKOFF, CORES, RANK, ROW, SPIN, WORLD, YIELD, P2P,  # noqa: E402
                         alltoallv_op, gloo_op, idle_barrier, iters_for, mpi_p2p_op, on_sub,
                         timed_many)


def bench_config(sub, group, M, N, sizes, scale, spin_shared=False):
    """``spin_shared``: m2n-spin also where ranks outnumber cores (to reproduce the hang)."""
    t = MpiTransport(sub)
    A, E = list(range(M)), list(range(M, M + N))
    cap = max(sizes) // ROW
    disp, comb = P2P(t, A, E, cap), P2P(t, E, A, cap)
    rows, raw_reqs = [], []
    for size in sizes:
        n = iters_for(size * M * N, scale)
        for direction, (s, r, p2p) in (("dispatch", (A, E, disp)), ("combine", (E, A, comb))):
            ops = {"m2n": p2p.op(size // ROW, BACKOFF), "m2n-yield": p2p.op(size // ROW, YIELD),
                   "alltoallv": alltoallv_op(sub, s, r, size),
                   "m2n-flatpoll": p2p.op(size // ROW, BACKOFF, flat_first_polls=True),
                   "mpi-p2p": mpi_p2p_op(sub, s, r, size, raw_reqs),
                   # A/A control: the same collective again, rated against the first, shows
                   # how often "<= Alltoallv" holds by chance between identical methods
                   "alltoallv-again": alltoallv_op(sub, s, r, size)}
            if M + N <= CORES or spin_shared:  # spinning ranks on shared cores measure the scheduler (up to
                # 131x Alltoallv) and, with the gloo pass, have hung MPI here (docs/comm.md)
                ops["m2n-spin"] = p2p.op(size // ROW, SPIN)
            got = timed_many(sub, n, ops)
            # gloo in its own pass: its worker threads linger after an op and slow whatever
            # runs next, which would bias an interleaved comparison against the MPI methods
            gops = {"gloo": gloo_op(group, sub.Get_rank(), M + N, s, r, size)}
            got.update(timed_many(sub, max(n // 2, 10), gops))
            for k, v in got.items():
                rows.append(dict(M=M, N=N, direction=direction, method=k, size=size,
                                 count=M * N, iters=len(v), p50=float(np.median(v)),
                                 p99=float(np.percentile(v, 99))))
    disp.ch.close(), comb.ch.close(), t.close()
    for req in raw_reqs:
        req.Free()
    return rows


def pingpong(sub, sizes, scale):
    """Ranks 0 and 1: raw MPI Send/Recv vs channel dispatch+combine; half round trip."""
    me, t = sub.Get_rank(), MpiTransport(sub)
    buf = np.ones(max(sizes), np.uint8)
    fwd, back = P2P(t, [0], [1], max(sizes) // ROW), P2P(t, [1], [0], max(sizes) // ROW)
    rows = []
    for size in sizes:
        n = iters_for(size, scale)

        def raw(i):
            if me == 0:
                sub.Send([buf, size, MPI.BYTE], 1, 7)
                sub.Recv([buf, size, MPI.BYTE], 1, 7)
            else:
                sub.Recv([buf, size, MPI.BYTE], 0, 7)
                sub.Send([buf, size, MPI.BYTE], 0, 7)

        def chan(policy):
            def run(i):
                for c in (fwd.ch, back.ch):
                    c.policy = policy
                if me == 0:
                    fwd.ch.post(fwd.ch.reserve(1, size // ROW), iteration=i, layer=0, micro_batch=0)
                    back.ch.recv(1, layer=0, micro_batch=0, iteration=i).wait().release()
                else:
                    fwd.ch.recv(0, layer=0, micro_batch=0, iteration=i).wait().release()
                    back.ch.post(back.ch.reserve(0, size // ROW), iteration=i, layer=0, micro_batch=0)
            return run
        got = timed_many(sub, n, {"mpi-raw": raw, "m2n-spin": chan(SPIN), "m2n-yield": chan(YIELD),
                                  "m2n": chan(BACKOFF)})
        for k, v in got.items():  # rank 0 times the round trip; report half of it
            v = np.array(v) / 2
            rows.append(dict(method=k, size=size, iters=len(v), p50=float(np.median(v)),
                             p99=float(np.percentile(v, 99))))
    for c in (fwd.ch, back.ch):
        for ring in c._send.values():  # the last combine may still be leaving
            for slot in ring:
                if slot.req is not None:
                    c._wait(slot.req, "drain", None)
        c.close()
    t.close()
    return rows


def mm_chunks(k, a, b, c, poll=None):
    for _ in range(k):
        torch.mm(a, b, out=c)                                                       # [256, 256]
        if poll is not None:
            poll()


def overlap(sub, rounds, size=2 << 20, chunks=15):
    """1 sender (rank 0), the others receive: compute alone vs compute with dispatch+combine in
    flight (with and without progress polls) vs compute then blocking Alltoallv."""
    me, t = sub.Get_rank(), MpiTransport(sub)
    A, E = [0], list(range(1, sub.Get_size()))
    disp, comb = P2P(t, A, E, size // ROW), P2P(t, E, A, size // ROW)
    a2av_d, a2av_c = alltoallv_op(sub, A, E, size), alltoallv_op(sub, E, A, size)
    a, b, c = torch.randn(256, 256), torch.randn(256, 256), torch.empty(256, 256)
    res = {k: {"compute": [], "round": []} for k in ("alone", "m2n", "m2n-noprogress", "alltoallv")}
    rows = size // ROW
    for r in range(rounds):
        for mode in res:
            idle_barrier(sub)
            t0 = time.perf_counter()
            if me == 0:
                if mode.startswith("m2n"):
                    for p in E:
                        disp.ch.post(disp.ch.reserve(p, rows), iteration=r, layer=0, micro_batch=0)
                    hs = [comb.ch.recv(p, layer=0, micro_batch=0, iteration=r) for p in E]
                tc = time.perf_counter()
                mm_chunks(chunks, a, b, c, t.progress if mode == "m2n" else None)
                res[mode]["compute"].append(time.perf_counter() - tc)
                if mode.startswith("m2n"):
                    for h in hs:
                        h.wait().release()
                elif mode == "alltoallv":
                    a2av_d(r), a2av_c(r)
                res[mode]["round"].append(time.perf_counter() - t0)
            elif mode.startswith("m2n"):
                disp.ch.recv(0, layer=0, micro_batch=0, iteration=r).wait().release()
                comb.ch.post(comb.ch.reserve(0, rows), iteration=r, layer=0, micro_batch=0).wait()
            elif mode == "alltoallv":
                a2av_d(r), a2av_c(r)
    disp.ch.close(), comb.ch.close(), t.close()
    return {k: {m: float(np.median(v)) for m, v in d.items() if v} for k, d in res.items()} if me == 0 else None


def wait_policies(sub, rounds, chunks=15):
    """Ranks 0 and 2 compute; rank 1 waits for their messages (sent when done) with each policy.
    Compute time on 0 and 2, and rank 1's wake-up delay after the last send."""
    me, t = sub.Get_rank(), MpiTransport(sub)
    ch = Channel(t, [0, 2], [1], MessageSpec.of(1, ts=((1,), torch.float64)), streams=1, depth=2)
    a, b, c = torch.randn(256, 256), torch.randn(256, 256), torch.empty(256, 256)
    modes = {"idle": None, "spin": SPIN, "yield": YIELD, "backoff": BACKOFF}
    res = {k: {"compute": [], "wake": []} for k in modes}
    for r in range(rounds):
        for mode, pol in modes.items():
            idle_barrier(sub)
            if me in (0, 2):
                tc = time.perf_counter()
                mm_chunks(chunks, a, b, c)
                res[mode]["compute"].append(time.perf_counter() - tc)
                if pol is not None:
                    ts = torch.tensor([[time.perf_counter()]], dtype=torch.float64)
                    ch.send(1, iteration=r, layer=0, micro_batch=0, ts=ts).wait()
            elif pol is not None:
                ch.policy = pol
                last = 0.0
                for p in (0, 2):
                    msg = ch.recv(p, layer=0, micro_batch=0, iteration=r).wait()
                    last = max(last, float(msg["ts"][0, 0]))
                    msg.release()
                res[mode]["wake"].append(time.perf_counter() - last)
    ch.close(), t.close()
    got = sub.gather(res, root=0)
    if me != 0:
        return None
    return {k: {"compute_r0": float(np.median(got[0][k]["compute"])),
                "compute_r2": float(np.median(got[2][k]["compute"])),
                "wake": float(np.median(got[1][k]["wake"])) if got[1][k]["wake"] else None}
            for k in modes}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="2048,8192,32768,131072,524288,2097152,8388608")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--configs", default="1x1,1x2,2x1,2x2", help="MxN list for the collectives")
    ap.add_argument("--spin-shared", action="store_true",
                    help="run m2n-spin where ranks outnumber cores too")
    ap.add_argument("--parts", default="collectives,pingpong,overlap,wait",
                    help="subset to run (a quick look while developing; the JSON then lacks the rest)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    sizes = [int(s) for s in args.sizes.split(",")]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=RANK,
                            world_size=WORLD.Get_size())
    out = {"collectives": [], "world": WORLD.Get_size()}
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    for M, N in configs if "collectives" in parts else ():
        group = dist.new_group(list(range(M + N)))  # collective over the whole world
        rows = on_sub(M + N, lambda sub: bench_config(sub, group, M, N, sizes, args.scale,
                                                               args.spin_shared))
        if RANK == 0:
            out["collectives"] += rows
            print(f"[bench rank0] {M}x{N} done", flush=True)
    if "pingpong" in parts:
        out["pingpong"] = on_sub(2, lambda sub: pingpong(sub, sizes, args.scale))
    if "overlap" in parts:
        out["overlap"] = on_sub(2, lambda sub: overlap(sub, args.rounds))
        out["overlap_1x2"] = on_sub(3, lambda sub: overlap(sub, args.rounds))
    if "wait" in parts:
        out["wait_policy"] = on_sub(3, lambda sub: wait_policies(sub, args.rounds))
    if RANK == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
