"""M2N dispatch / N2M combine vs MPI_Alltoallv vs gloo all_to_all, plus raw MPI ping-pong,
compute overlap and the wait-policy test. One run, nccl-tests-style tables, JSON in
perf/results/bench_m2n.json.

    .venv/bin/python perf/bench/bench_m2n.py [--quick]
    .venv/bin/python perf/bench/bench_m2n.py --parts pingpong --sizes 2048,8388608   # a quick look

A partial or quick run (--parts/--configs/--sizes/--scale/--quick) prints its tables and ratios but
writes its JSON to $TMPDIR/bench_m2n_partial.json, never over the full result.

Launches `mpiexec -n 4 perf/jobs/bench_m2n_mpi.py` (4 ranks: the 2x2 config needs them even on a
2-core machine; say so when quoting numbers). Columns: size = bytes per message, count =
messages per op (M*N), time = per-op wall time (max over ranks, barrier before each op),
algbw = size*count/time, busbw = algbw / receivers (ingress bandwidth of one receiving rank).
"""
import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import JOBS, RESULTS  # noqa: E402
from mpi_launch import MPIEXEC, run_ranks  # noqa: E402

from megainfer.bench.m2n_targets import COMPARED, check_targets, human  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_collectives(rows):
    print(f"\n{'MxN':>4} {'dir':>8} {'method':>15} {'size':>6} {'count':>5} {'p50 us':>10} "
          f"{'p99 us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for r in rows:
        recv = r["N"] if r["direction"] == "dispatch" else r["M"]
        alg = r["size"] * r["count"] / r["p50"] / 1e9
        r["algbw"], r["busbw"] = alg, alg / recv
        print(f"{r['M']}x{r['N']:<2} {r['direction']:>8} {r['method']:>15} {human(r['size']):>6} "
              f"{r['count']:>5} {r['p50'] * 1e6:>10.1f} {r['p99'] * 1e6:>10.1f} {alg:>11.3f} "
              f"{r['busbw']:>11.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    ap.add_argument("--scale", type=float, default=None,
                    help="iterations scale (0.1 with --quick); a scaled run is a partial one")
    ap.add_argument("--out", default=None, help="JSON path (default perf/results/bench_m2n.json, "
                    "or $TMPDIR/bench_m2n_partial.json for a partial or quick run)")
    ap.add_argument("--parts", default=None, help="subset of collectives,pingpong,overlap,wait")
    ap.add_argument("--configs", default=None, help="MxN list for the collectives, e.g. 1x1,2x2")
    ap.add_argument("--sizes", default=None, help="message sizes in bytes, comma separated")
    ap.add_argument("--spin-shared", action="store_true", help="m2n-spin also where ranks "
                    "outnumber cores (off by default: with gloo in the same processes it hung MPI, "
                    "docs/comm.md)")
    ap.add_argument("--timeout", type=int, default=1800,
                    help="seconds before a stuck run is killed (a full run takes ~3 min)")
    ap.add_argument("--mpiexec", default=MPIEXEC,
                    help="mpiexec to launch with (default: the one beside this Python)")
    args = ap.parse_args()
    partial = args.quick or args.spin_shared or any(
        x is not None for x in (args.parts, args.configs, args.sizes, args.scale))
    args.out = args.out or (os.path.join(tempfile.gettempdir(), "bench_m2n_partial.json")
                            if partial else os.path.join(RESULTS, "bench_m2n.json"))
    mpiexec = args.mpiexec
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw.json")
        cmd = [mpiexec, "-n", "4", sys.executable, os.path.join(JOBS, "bench_m2n_mpi.py"),
               "--port", str(free_port()), "--out", raw]
        if args.quick or args.scale is not None:  # fewer iterations: never the full result
            cmd += ["--scale", str(args.scale or 0.1)]
        if args.quick:
            cmd += ["--rounds", "4"]
        cmd += ["--spin-shared"] if args.spin_shared else []
        for opt in ("parts", "configs", "sizes"):
            if getattr(args, opt) is not None:
                cmd += [f"--{opt}", getattr(args, opt)]
        load_before = os.getloadavg()
        try:
            done = run_ranks(cmd, args.timeout)
        except subprocess.TimeoutExpired:
            sys.exit(f"bench_m2n: the MPI ranks did not finish in {args.timeout} s (a stuck run: "
                     f"docs/comm.md, 'The 2×2 hang'); nothing written")
        done.check_returncode()
        with open(raw) as f:
            res = json.load(f)
    print_collectives(res["collectives"])
    report(res)
    targets = check_targets(res)
    summary = {k: ({kk: vv for kk, vv in v.items() if kk != "ratios"} if k in COMPARED else v)
               for k, v in targets.items()}
    print("\ntargets:", json.dumps(summary, indent=1))
    res.update(targets=targets, date=datetime.datetime.now().isoformat(timespec="seconds"),
               machine=dict(platform=platform.platform(), processor=platform.processor(),
                            cpu_count=os.cpu_count(), python=platform.python_version(),
                            loadavg_before=load_before, loadavg_after=os.getloadavg()),
               quick=args.quick, partial=partial, command=" ".join(sys.argv))
    write_json(args.out, res)


def report(res):
    if "pingpong" in res:
        print(f"\nping-pong 1x1 (half round trip)\n{'method':>10} {'size':>6} {'p50 us':>10} "
              f"{'p99 us':>10} {'GB/s':>8}")
    for r in res.get("pingpong", ()):
        print(f"{r['method']:>10} {human(r['size']):>6} {r['p50'] * 1e6:>10.1f} "
              f"{r['p99'] * 1e6:>10.1f} {r['size'] / r['p50'] / 1e9:>8.3f}")
    for key, what in (("overlap", "1 sender, 1 receiver (2 ranks)"),
                      ("overlap_1x2", "1 sender, 2 receivers (3 ranks)")):
        if key not in res:
            continue
        print(f"\noverlap, {what}: 2 MiB dispatch + 2 MiB combine per receiver; ms, median")
        for k, v in res[key].items():
            print(f"{k:>15} compute {v['compute'] * 1e3:8.2f}   round {v['round'] * 1e3:8.2f}")
    if "wait_policy" in res:
        print("\nwait policy (ranks 0, 2 compute; rank 1 waits; 3 ranks, ms, median)")
    for k, v in res.get("wait_policy", {}).items():
        wake = "-" if v["wake"] is None else f"{v['wake'] * 1e6:.0f} us"
        print(f"{k:>8} compute r0 {v['compute_r0'] * 1e3:7.2f}  r2 {v['compute_r2'] * 1e3:7.2f}"
              f"  wake-up {wake}")


if __name__ == "__main__":
    main()
