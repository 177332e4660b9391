"""The disaggregated pipeline (1 attention + 1 expert rank, 1 thread each) on two checkouts of
the code, interleaved in one run: T_a and T_e per layer, the decode iteration, before and after.

    python perf/bench/bench_pipeline_before_after.py --before /path/to/old/worktree [--rounds 5]
        (JSON: perf/results/bench_pipeline_before_after.json)

Each side is a git worktree with its own .venv (its editable install pointing at itself); each
launch runs that side's own pipeline_job.py (perf/jobs/ or, in older trees, perf/) under that
side's mpiexec with the pipeline bench's shape (perf/harness/pipeline_shape.py), traced, for
every configuration given (default: disaggregated m=1 and m=2). Rounds alternate the side that
goes first (before, after / after, before ...) against drift; the figures are medians over
rounds, the traces are read by this tree's ``pipeline_metrics``. The load average is recorded
beside every launch.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from mpi_launch import run_ranks  # noqa: E402
from perf_paths import PERF, RESULTS  # noqa: E402
from pipeline_shape import BENCH_SHAPE  # noqa: E402

from megainfer.bench.results_io import write_json  # noqa: E402
from megainfer.runtime.trace_metrics import pipeline_metrics  # noqa: E402

METRICS = ("T_a_us", "T_e_us", "T_c_us", "hidden_fraction")


def side_of(root: str) -> dict:
    """The worktree's python, mpiexec, job program and commit."""
    root = os.path.abspath(root)
    job = next((p for p in (os.path.join(root, "perf", "jobs", "pipeline_job.py"),
                            os.path.join(root, "perf", "pipeline_job.py")) if os.path.exists(p)), None)
    py, mpiexec = os.path.join(root, ".venv", "bin", "python"), os.path.join(root, ".venv", "bin", "mpiexec")
    for what, p in (("pipeline_job.py", job), ("python", py), ("mpiexec", mpiexec)):
        if p is None or not os.path.exists(p):
            raise SystemExit(f"--before/--after {root}: no {what} there")
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    return {"root": root, "python": py, "mpiexec": mpiexec, "job": job, "commit": commit}


def launch(side: dict, configs: list[str], tmp: str, tag: str) -> list[dict]:
    out = os.path.join(tmp, f"{tag}.json")
    cmd = [side["mpiexec"], "-n", "2", side["python"], side["job"], out, ",".join(configs),
           "--trace-root", os.path.join(tmp, tag), *BENCH_SHAPE]
    p = run_ranks(cmd, 1800, capture=True)
    if p.returncode:
        raise RuntimeError(f"{tag} failed ({' '.join(cmd)}):\n{p.stderr[-3000:]}")
    with open(out) as f:
        runs = json.load(f)
    for r in runs:
        with open(r["trace"]) as f:
            r["metrics"] = pipeline_metrics(json.load(f))
    return runs


def summarise(samples: list[dict]) -> dict:
    """Medians over rounds of one side's one configuration."""
    row = {"decode_iter_ms": 1e3 * statistics.median(s["decode_iter_s"] for s in samples),
           "decode_iter_ms_samples": [round(1e3 * s["decode_iter_s"], 3) for s in samples]}
    for k in METRICS:
        vals = [s["metrics"].get(k) for s in samples]
        vals = [v for v in vals if isinstance(v, (int, float)) and v == v]
        row[k.replace("_us", "_ms")] = (statistics.median(vals) / (1e3 if k.endswith("_us") else 1)
                                        if vals else None)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="worktree of the old code, with its own .venv")
    ap.add_argument("--after", default=os.path.dirname(PERF), help="worktree of the new code (this one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default="disaggregated:1,disaggregated:2")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_pipeline_before_after.json"))
    a = ap.parse_args()
    sides = {"before": side_of(a.before), "after": side_of(a.after)}
    configs = [f"{c}:trace" for c in a.configs.split(",")]
    tmp = tempfile.mkdtemp(prefix="bench_pipeline_ba_")
    samples = {(s, c): [] for s in sides for c in a.configs.split(",")}
    loads = []
    for r in range(a.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for s in order:
            l0 = os.getloadavg()[0]
            for run in launch(sides[s], configs, tmp, f"{s}{r}"):
                samples[(s, f"{run['mode']}:{run['m']}")].append(run)
            loads.append({"round": r, "side": s, "load1_start": l0, "load1_end": os.getloadavg()[0]})
            print(f"round {r + 1}/{a.rounds} {s} done (load {l0:.2f} -> {loads[-1]['load1_end']:.2f})",
                  flush=True)
    rows = []
    for c in a.configs.split(","):
        b, n = summarise(samples[("before", c)]), summarise(samples[("after", c)])
        ratio = {k: (b[k] / n[k] if b[k] and n[k] else None)
                 for k in ("decode_iter_ms", "T_a_ms", "T_e_ms")}
        rows.append({"config": c, "before": b, "after": n, "before_over_after": ratio})
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()} "
              f"{os.cpu_count()} cores, {platform.python_version()}, torch 1 thread per rank",
              "shape": samples[("after", a.configs.split(",")[0])][0]["shape"], "rounds": a.rounds,
              "sides": {s: {"commit": v["commit"]} for s, v in sides.items()}, "rows": rows,
              "loads": loads, "load1_median": statistics.median(x["load1_start"] for x in loads),
              "baseline": "before = the other worktree, launched alternately in the same run"}
    write_json(a.out, result)
    print(f"\n{'config':<18}{'side':<8}{'iter ms':>9}{'T_a ms':>8}{'T_e ms':>8}{'T_c ms':>8}{'hidden':>8}")
    fmt = lambda v: f"{v:8.2f}" if v is not None else f"{'-':>8}"  # noqa: E731
    for row in rows:
        for s in ("before", "after"):
            x = row[s]
            print(f"{row['config']:<18}{s:<8}{x['decode_iter_ms']:9.2f}{fmt(x['T_a_ms'])}"
                  f"{fmt(x['T_e_ms'])}{fmt(x['T_c_ms'])}{fmt(x['hidden_fraction'])}")
        q = row["before_over_after"]
        print(f"{row['config']:<18}{'b/a':<8}{fmt(q['decode_iter_ms'])} {fmt(q['T_a_ms'])}{fmt(q['T_e_ms'])}")
    print(f"load average (1 min) median {result['load1_median']:.2f}  ->  {a.out}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
