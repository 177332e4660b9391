"""Online re-planning on this machine (docs/replan.md): a workload whose attention:expert balance
shifts, run on every fixed split of ``--ranks`` ranks and with re-planning; and a steady one,
re-planning on vs off from the same split.

    python perf/bench/bench_replan.py [--ranks 4 --short 24 --short-prompt 16 --long 8
                                 --long-prompt 400 --output 48 --interval 16 --min-gain 0.1
                                 --phases --repeats 1]

Shifting workload (greedy, eos ignored, random prompts, all at once, handed out in order):
``--short`` prompts of ``--short-prompt`` tokens, then ``--long`` of ``--long-prompt``, each
generating ``--output`` tokens: short contexts first, long ones later. Steady workload: the
short segment alone. Model: the ~49M-parameter Mixtral-shaped bench50m (dummy weights, fp32,
one thread per rank, MPI transport), ``m`` micro-batches. Each run is one mpiexec launch
(``perf/jobs/replan_bench_job.py``: a warm-up job, then the measured one).

Figures per run: job seconds, the switches (iteration, old -> new, predicted gain, switch
seconds, measured gain), per-phase median iteration time of rank 0's steps, and whether the
greedy tokens equal the fixed-plan runs'. Summary: re-planning vs the best fixed split on the
shifting workload (goal: >= 15% faster), re-planning vs fixed on the steady one (goal: <= 2%
slower). ``--phases``: first every fixed split on each segment alone, so the table shows
whether the best split really changes between the segments (re-planning can only beat the best
fixed split when it does). ``--repeats N``: each run N times, its figures the median run's.
Writes ``perf/results/bench_replan.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402

from mpi_launch import run_job  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--short", type=int, default=24)
    ap.add_argument("--short-prompt", type=int, default=16)
    ap.add_argument("--long", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=400)
    ap.add_argument("--output", type=int, default=48)
    ap.add_argument("--long-output", type=int, default=None, help="default: --output")
    ap.add_argument("--m", type=int, default=2)
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--min-gain", type=float, default=0.10)
    ap.add_argument("--start", type=int, default=1, help="attention replicas re-planning starts from")
    ap.add_argument("--steady-start", type=int, default=2)
    ap.add_argument("--workloads", default="shifting,steady")
    ap.add_argument("--phases", action="store_true",
                    help="each segment alone on every split first")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration (median)")
    ap.add_argument("--micro-batches", default="hold", choices=("hold", "plan"),
                    help="replan.micro_batches")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_replan.json"))
    a = ap.parse_args()
    base = dict(m=a.m, max_num_seqs=16, max_num_batched_tokens=512, block_size=16,
                num_blocks=1024)
    short = [a.short, a.short_prompt, a.output]
    shifting = [short, [a.long, a.long_prompt, a.long_output or a.output]]
    steady = [short]
    replan = dict(enabled=True, interval=a.interval, min_gain=a.min_gain,
                  micro_batches=a.micro_batches)
    runs = []
    if a.phases:
        runs = [(f"phase {k}", f"fixed a{n}e{a.ranks - n}", n, [seg], None)
                for k, seg in (("short", short), ("long", shifting[1])) for n in range(1, a.ranks)]
    runs += [("shifting", f"fixed a{n}e{a.ranks - n}", n, shifting, None)
             for n in range(1, a.ranks)]
    runs.append(("shifting", f"replan from a{a.start}e{a.ranks - a.start}", a.start, shifting,
                 replan))
    s = a.steady_start
    runs += [("steady", f"fixed a{s}e{a.ranks - s}", s, steady, None),
             ("steady", f"replan from a{s}e{a.ranks - s}", s, steady, replan)]
    rows, wanted = [], a.workloads.split(",")
    runs = [x for x in runs if x[0] in wanted or x[0].startswith("phase")]
    for workload, name, n_a, segs, rp in runs:
        cfg = dict(base, A=n_a, E=a.ranks - n_a, segments=segs, replan=rp)
        reps = [run_job(a.ranks, "replan_bench_job.py", f"/tmp/bench_replan_{len(rows)}_{i}.json",
                        [json.dumps(cfg)], timeout_s=1800) for i in range(a.repeats)]
        r = sorted(reps, key=lambda x: x["seconds"])[len(reps) // 2]  # the median run
        rows.append(dict(workload=workload, run=name, **r,
                         repeat_seconds=[x["seconds"] for x in reps]))
        runs_s = [round(x["seconds"], 2) for x in reps]
        print(f"{workload:11s} {name:20s} {r['seconds']:7.2f} s (runs {runs_s}), "
              f"switches {[(x['iteration'], x['old'] + '->' + x['new']) for x in r['replans']]}",
              flush=True)
    ref = {w: next(r["tokens"] for r in rows if r["workload"] == w)
           for w in dict.fromkeys(r["workload"] for r in rows)}
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
    for k in ("short", "long"):
        ph = [r for r in rows if r["workload"] == f"phase {k}"]
        if ph:
            best = min(ph, key=lambda r: r["seconds"])
            summary[f"phase_{k}_best"] = best["run"]
            summary[f"phase_{k}_seconds"] = {r["run"]: r["seconds"] for r in ph}
            print(f"\nphase {k} alone: " + ", ".join(f"{r['run']} {r['seconds']:.2f} s" for r in ph)
                  + f": best {best['run']}")
    if "phase_short_best" in summary and "phase_long_best" in summary:
        summary["optimum_shifts"] = summary["phase_short_best"] != summary["phase_long_best"]
        print(f"the best split {'changes' if summary['optimum_shifts'] else 'does not change'} "
              "between the segments")
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
