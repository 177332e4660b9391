"""Online re-planning on this machine (docs/replan.md): a workload whose attention:expert balance
shifts, run on every fixed split of ``--ranks`` ranks and with re-planning; and a steady one,
re-planning on vs off from the same split.

    python perf/bench_replan.py [--ranks 4 --short 24 --short-prompt 16 --long 8
                                 --long-prompt 400 --output 48 --interval 16 --min-gain 0.1]

Shifting workload (greedy, eos ignored, random prompts, all at once, handed out in order):
``--short`` prompts of ``--short-prompt`` tokens, then ``--long`` of ``--long-prompt``, each
generating ``--output`` tokens: short contexts first, long ones later. Steady workload: the
short segment alone. Model: the ~49M-parameter Mixtral-shaped bench50m (dummy weights, fp32,
one thread per rank, MPI transport), ``m`` micro-batches. Each run is one mpiexec launch
(``perf/replan_bench_job.py``: a warm-up job, then the measured one).

Figures per run: job seconds, the switches (iteration, old -> new, predicted gain, switch
seconds, measured gain), per-phase median iteration time of rank 0's steps, and whether the
greedy tokens equal the fixed-plan runs'. Summary: re-planning vs the best fixed split on the
shifting workload (goal: >= 15% faster), re-planning vs fixed on the steady one (goal: <= 2%
slower). Writes ``perf/results/bench_replan.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from mpi_launch import run_job  # noqa: E402
from results_io import write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--short", type=int, default=24)
    ap.add_argument("--short-prompt", type=int, default=16)
    ap.add_argument("--long", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=400)
    ap.add_argument("--output", type=int, default=48)
    ap.add_argument("--m", type=int, default=2)
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--min-gain", type=float, default=0.10)
    ap.add_argument("--start", type=int, default=1, help="attention replicas re-planning starts from")
    ap.add_argument("--steady-start", type=int, default=2)
    ap.add_argument("--workloads", default="shifting,steady")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_replan.json"))
    a = ap.parse_args()
    base = dict(m=a.m, max_num_seqs=16, max_num_batched_tokens=512, block_size=16,
                num_blocks=1024)
    short = [a.short, a.short_prompt, a.output]
    shifting, steady = [short, [a.long, a.long_prompt, a.output]], [short]
    replan = dict(enabled=True, interval=a.interval, min_gain=a.min_gain)
    runs = [("shifting", f"fixed a{n}e{a.ranks - n}", n, shifting, None)
            for n in range(1, a.ranks)]
    runs.append(("shifting", f"replan from a{a.start}e{a.ranks - a.start}", a.start, shifting,
                 replan))
    s = a.steady_start
    runs += [("steady", f"fixed a{s}e{a.ranks - s}", s, steady, None),
             ("steady", f"replan from a{s}e{a.ranks - s}", s, steady, replan)]
    rows, wanted = [], a.workloads.split(",")
    runs = [x for x in runs if x[0] in wanted]
    for workload, name, n_a, segs, rp in runs:
        cfg = dict(base, A=n_a, E=a.ranks - n_a, segments=segs, replan=rp)
        r = run_job(a.ranks, "replan_bench_job.py", f"/tmp/bench_replan_{len(rows)}.json",
                    [json.dumps(cfg)], timeout_s=1800)
        rows.append(dict(workload=workload, run=name, **r))
        print(f"{workload:9s} {name:20s} {r['seconds']:7.2f} s, switches "
              f"{[(x['iteration'], x['old'] + '->' + x['new']) for x in r['replans']]}", flush=True)
    ref = {w: next(r["tokens"] for r in rows if r["workload"] == w) for w in wanted}
    for r in rows:
        r["tokens_match"] = r.pop("tokens") == ref[r["workload"]]
    print("\nworkload | run | job s | switches (iteration old->new, predicted, switch s, "
          "measured) | phases (steps, median iteration ms) | tokens match")
    for r in rows:
        sw = "; ".join(f"{x['iteration']} {x['old']}->{x['new']} pred "
                       f"{_pct(x['predicted_gain'])} {x['seconds']:.2f}s meas "
                       f"{_pct(x.get('measured_gain'))}" for x in r["replans"]) or "-"
        ph = ", ".join(f"{p['steps']}x{p['median_step_ms']:.0f}" for p in r["phases"]
                       if p["median_step_ms"] is not None)
        print(f"{r['workload']} | {r['run']} | {r['seconds']:.2f} | {sw} | {ph} | "
              f"{r['tokens_match']}")
    summary = {}
    if "shifting" in wanted:
        fixed = [r for r in rows if r["workload"] == "shifting" and r["run"].startswith("fixed")]
        best = min(fixed, key=lambda r: r["seconds"])
        rep = next(r for r in rows if r["workload"] == "shifting" and r["run"].startswith("replan"))
        summary.update(shifting_best_fixed=best["run"], shifting_best_fixed_s=best["seconds"],
                       shifting_replan_s=rep["seconds"],
                       shifting_speedup_vs_best_fixed=best["seconds"] / rep["seconds"] - 1)
        print(f"\nshifting: re-planning {rep['seconds']:.2f} s vs best fixed ({best['run']}) "
              f"{best['seconds']:.2f} s: {100 * summary['shifting_speedup_vs_best_fixed']:+.1f}% "
              "(goal >= +15%)")
    if "steady" in wanted:
        st_f, st_r = (next(r for r in rows if r["workload"] == "steady" and r["run"].startswith(k))
                      for k in ("fixed", "replan"))
        summary.update(steady_fixed_s=st_f["seconds"], steady_replan_s=st_r["seconds"],
                       steady_cost=st_r["seconds"] / st_f["seconds"] - 1)
        print(f"steady: re-planning {st_r['seconds']:.2f} s vs fixed {st_f['seconds']:.2f} s: "
              f"cost {100 * summary['steady_cost']:+.1f}% (goal <= +2%)")
    write_json(a.out, dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(), cpus=os.cpu_count(), args=vars(a), summary=summary, rows=rows))


def _pct(v) -> str:
    return "n/a" if v is None or v != v else f"{100 * v:+.1f}%"


if __name__ == "__main__":
    main()
