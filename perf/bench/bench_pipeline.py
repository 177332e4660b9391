"""Ping-pong pipeline benchmark: decode iteration time and output tokens/s for m = 1..4 in
disaggregated mode (1 attention rank + 1 expert rank, one rank per core), against colocated mode
on the same 2 ranks (each rank attention + half the experts; m = 1, and m = 2 two-batch overlap),
same model, batch and kernels. Traced runs give the measured T_a, T_e, T_c and the fraction of
each micro-batch's round trip hidden behind compute; one pair of runs with and without tracing
gives the tracing overhead.

    python perf/bench/bench_pipeline.py [--repeats 3] [--hidden 512 ...]   (JSON: perf/results/bench_pipeline.json)

Every launch runs all configurations in turn; the figure per configuration is the median over
launches of the median decode step time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from mpi_launch import run_job  # noqa: E402
from perf_paths import RESULTS  # noqa: E402
from pipeline_shape import BENCH_SHAPE  # noqa: E402

from megainfer.bench.results_io import write_json  # noqa: E402

CONFIGS = ["disaggregated:1", "disaggregated:2", "disaggregated:3", "disaggregated:4",
           "colocated:1", "colocated:2"]
TRACED = ["disaggregated:1:trace", "disaggregated:2:trace", "disaggregated:3:trace",
          "colocated:1:trace", "colocated:2:trace"]


def launch(configs, shape_args, out_dir, trace_root) -> list[dict]:
    return run_job(2, "pipeline_job.py", os.path.join(out_dir, "run.json"),
                   [",".join(configs), "--trace-root", trace_root, *shape_args])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_pipeline.json"))
    ap.add_argument("--timeline", default=None, help="write the m=2 timeline PNG here")
    a, extra = ap.parse_known_args()
    shape_args = BENCH_SHAPE + extra  # later flags win in argparse
    tmp = tempfile.mkdtemp(prefix="bench_pipeline_")
    trace_root = os.path.join(tmp, "traces")
    runs = []
    for r in range(a.repeats):
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]  # alternate order against drift
        runs += launch(order, shape_args, tmp, trace_root)
        print(f"launch {r + 1}/{a.repeats} done", flush=True)
    traced = launch(TRACED, shape_args, tmp, trace_root)
    untraced_again = launch(["disaggregated:2"], shape_args, tmp, trace_root)

    from megainfer.runtime.trace_metrics import pipeline_metrics
    rows = []
    for c in CONFIGS:
        mode, m = c.split(":")[0], int(c.split(":")[1])
        its = [x["decode_iter_s"] for x in runs if x["mode"] == mode and x["m"] == m]
        rows.append({"mode": mode, "m": m, "decode_iter_ms": 1e3 * statistics.median(its),
                     "decode_iter_ms_samples": [1e3 * x for x in its],
                     "tokens_per_s": runs[0]["batch"] / statistics.median(its) if "batch" in runs[0]
                     else None})
    base = next(r for r in rows if r["mode"] == "disaggregated" and r["m"] == 1)
    for r in rows:
        r["speedup_vs_disagg_m1"] = base["decode_iter_ms"] / r["decode_iter_ms"]
    metrics = {}
    for t in traced:
        with open(t["trace"]) as f:
            metrics[f"{t['mode']}:{t['m']}"] = pipeline_metrics(json.load(f))
    t2 = next(t for t in traced if t["mode"] == "disaggregated" and t["m"] == 2)
    m2 = next(r for r in rows if r["mode"] == "disaggregated" and r["m"] == 2)
    overhead = t2["decode_iter_s"] / statistics.median(
        [untraced_again[0]["decode_iter_s"], m2["decode_iter_ms"] / 1e3]) - 1
    if a.timeline:
        from megainfer.tools.timeline import draw_timeline
        draw_timeline(t2["trace"], a.timeline, iteration=10)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} "
              f"{os.cpu_count()} cores, {platform.python_version()}, torch 1 thread per rank",
              "shape": runs[0].get("shape"), "repeats": a.repeats, "rows": rows,
              "trace_metrics": metrics, "trace_overhead": overhead,
              "baseline": "disaggregated m=1 (no overlap) and colocated on the same 2 ranks"}
    write_json(a.out, result)
    print(f"\n{'mode':<14}{'m':>3}{'iter ms':>10}{'tok/s':>9}{'vs m=1':>8}"
          f"{'T_a ms':>9}{'T_e ms':>9}{'T_c ms':>9}{'hidden':>8}")
    for r in rows:
        mt = metrics.get(f"{r['mode']}:{r['m']}", {})
        fmt = lambda v: f"{v / 1e3:9.2f}" if isinstance(v, float) and v == v else f"{'-':>9}"  # noqa
        hid = mt.get("hidden_fraction")
        print(f"{r['mode']:<14}{r['m']:>3}{r['decode_iter_ms']:10.2f}{r['tokens_per_s'] or 0:9.0f}"
              f"{r['speedup_vs_disagg_m1']:8.2f}{fmt(mt.get('T_a_us'))}{fmt(mt.get('T_e_us'))}"
              f"{fmt(mt.get('T_c_us'))}{(f'{100 * hid:7.0f}%' if hid is not None and hid == hid else '      -')}")
    print(f"tracing overhead on disaggregated m=2: {100 * overhead:+.1f}%  ->  {a.out}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
