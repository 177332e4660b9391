"""Where the channel's time goes when ranks outnumber cores: the same M2N traffic with less
and less of the channel, side by side in one run, against MPI_Alltoallv.

    .venv/bin/python perf/bench_m2n_ladder.py     # ~10 s; perf/results/bench_m2n_ladder.json

Rungs (perf/m2n_ladder_ops.py): ``mpi-p2p`` (one Startall/Testall, receives posted in the op),
``lean`` (the channel's pattern in bare mpi4py: receives posted ahead, each request waited in
turn), ``inline`` (the channel's slots, rings and headers, its work written out), ``m2n`` (the
channel's API). ``alltoallv-again`` is the A/A control. Per cell: p50 / Alltoallv's p50, and
the thread CPU time of one op on its busiest rank. Configs 1x2, 2x1, 2x2 (3-4 ranks on this
2-core machine: where bench_m2n.py finds the channel behind Alltoallv).
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mpi_launch import MPIEXEC, run_ranks  # noqa: E402
from results_io import write_json  # noqa: E402

RUNGS = ("alltoallv-again", "mpi-p2p", "lean", "inline", "m2n")


def summarize(rows) -> dict:
    """Per rung: p50 / Alltoallv per cell, its median and max, and median CPU per op (us)."""
    a2av = {(r["M"], r["N"], r["direction"], r["size"]): r
            for r in rows if r["method"] == "alltoallv"}
    out = {}
    for m in RUNGS:
        mine = [r for r in rows if r["method"] == m]
        if not mine:
            continue
        ratios = [r["p50"] / a2av[(r["M"], r["N"], r["direction"], r["size"])]["p50"] for r in mine]
        cpu = [r["cpu_max"] / a2av[(r["M"], r["N"], r["direction"], r["size"])]["cpu_max"]
               for r in mine]
        out[m] = dict(p50_vs_alltoallv_median=statistics.median(ratios),
                      p50_vs_alltoallv_max=max(ratios),
                      p50_le_alltoallv=f"{sum(x <= 1 for x in ratios)}/{len(ratios)}",
                      cpu_vs_alltoallv_median=statistics.median(cpu))
    return out


def print_table(rows):
    cells = sorted({(r["M"], r["N"], r["direction"], r["size"]) for r in rows})
    by = {(r["M"], r["N"], r["direction"], r["size"], r["method"]): r for r in rows}
    print(f"{'cell':>18} {'a2av us':>8} " + " ".join(f"{m:>15}" for m in RUNGS)
          + "   (p50 / Alltoallv; CPU us per op, busiest rank)")
    for c in cells:
        a = by[c + ("alltoallv",)]
        line = f"{c[0]}x{c[1]} {c[2]:>8} {c[3] >> 10:>4}K {a['p50'] * 1e6:>8.1f} "
        line += " ".join(f"{by[c + (m,)]['p50'] / a['p50']:>7.2f} "
                         f"{by[c + (m,)]['cpu_max'] * 1e6:>5.0f}us" for m in RUNGS)
        print(line + f"   a2av cpu {a['cpu_max'] * 1e6:.0f}us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2048,8192,32768,131072")
    ap.add_argument("--configs", default="1x2,2x1,2x2")
    ap.add_argument("--scale", type=float, default=2.0, help="iterations scale")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_m2n_ladder.json"))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--mpiexec", default=MPIEXEC,
                    help="mpiexec to launch with (default: the one beside this Python)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw.json")
        cmd = [args.mpiexec, "-n", "4", sys.executable, os.path.join(HERE, "bench_m2n_ladder_mpi.py"),
               "--out", raw, "--sizes", args.sizes, "--configs", args.configs,
               "--scale", str(args.scale)]
        load_before = os.getloadavg()
        try:
            run_ranks(cmd, args.timeout).check_returncode()
        except subprocess.TimeoutExpired:
            sys.exit(f"bench_m2n_ladder: the ranks did not finish in {args.timeout} s")
        with open(raw) as f:
            res = json.load(f)
    print_table(res["collectives"])
    summary = summarize(res["collectives"])
    print("\nsummary:", json.dumps(summary, indent=1))
    res.update(summary=summary, date=datetime.datetime.now().isoformat(timespec="seconds"),
               machine=dict(platform=platform.platform(), cpu_count=os.cpu_count(),
                            python=platform.python_version(), loadavg_before=load_before,
                            loadavg_after=os.getloadavg()),
               command=" ".join(sys.argv))
    write_json(args.out, res)


if __name__ == "__main__":
    main()
