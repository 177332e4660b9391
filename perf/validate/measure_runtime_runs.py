"""Measure the runtime runs the performance model is validated on (perf/validate/validate_perfmodel.py).

Each run decodes the ``pipeline_bench`` shape (conf/plan_model/pipeline_bench.yaml, the shape of
perf/bench/bench_pipeline.py) with the disaggregated runtime under ``mpiexec -n A+E`` on this node and
stores its median decode iteration time as ``perf/results/runtime_runs/disagg_a{A}e{E}_b{B}_m{m}.json``:

    python perf/validate/measure_runtime_runs.py [--only a1e1_b192] [--repeats 1] [--in-situ]

A launch serves all micro-batch counts of one (A, E, B); with ``--repeats`` > 1 the launches
alternate and each run keeps the median of its repeats. With ``--in-situ`` every repeat also
makes the traced calibration runs of ``perf/validate/calibrate_in_situ.py`` (other batch sizes), and the
fit of all their spans replaces the ``pipeline_bench`` fit in conf/hardware/cpu_node.yaml: the
model's layer times and the runs it is validated on are then measured side by side, at the
same moments of a shared machine. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from mpi_launch import run_job  # noqa: E402
from pipeline_shape import DECODE, PROMPT, job_args  # noqa: E402

# (attention replicas, expert ranks, global batch, micro-batch counts)
RUNS = [(1, 1, 192, (1, 2, 3, 4)), (1, 1, 288, (1, 2)), (1, 1, 96, (1, 2)),
        (1, 2, 192, (1, 2)), (2, 1, 192, (1, 2))]


def launch(A: int, E: int, B: int, ms, tmp: str) -> list[dict]:
    configs = ",".join(f"disaggregated:{m}" for m in ms)
    return run_job(A + E, "pipeline_job.py", os.path.join(tmp, f"a{A}e{E}_b{B}.json"),
                   [configs, *job_args(B, A)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma list of aAeE_bB keys to measure")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out-dir", default=os.path.join(RESULTS, "runtime_runs"))
    ap.add_argument("--in-situ", action="store_true", help="also calibrate in situ, interleaved")
    ap.add_argument("--in-situ-batches", default=None, help="default: calibrate_in_situ's")
    ap.add_argument("--profile", default=None, help="default: conf/hardware/cpu_node.yaml")
    a = ap.parse_args(argv)
    todo = [r for r in RUNS if a.only is None or f"a{r[0]}e{r[1]}_b{r[2]}" in a.only.split(",")]
    if not todo:
        sys.exit(f"--only {a.only!r} matches none of " +
                 ", ".join(f"a{r[0]}e{r[1]}_b{r[2]}" for r in RUNS))
    tmp = tempfile.mkdtemp(prefix="runtime_runs_")
    samples: dict[tuple, list[float]] = {}
    attn, expert = [], []  # in-situ calibration spans
    if a.in_situ:
        import calibrate_in_situ as cis
        cal_batches = [int(x) for x in (a.in_situ_batches or cis.DEFAULT_BATCHES).split(",")]
    for rep in range(a.repeats):
        for A, E, B, ms in (todo if rep % 2 == 0 else todo[::-1]):
            for res in launch(A, E, B, ms, tmp):
                samples.setdefault((A, E, B, res["m"]), []).append(res["decode_iter_s"])
        if a.in_situ:
            cis.collect(cal_batches if rep % 2 == 0 else cal_batches[::-1], tmp, attn, expert)
    os.makedirs(a.out_dir, exist_ok=True)
    date = datetime.date.today().isoformat()
    print(f"{'run':<22}{'decode iteration ms':>20}")
    for (A, E, B, m), xs in sorted(samples.items()):
        name = f"disagg_a{A}e{E}_b{B}_m{m}"
        row = {"model": "pipeline_bench",
               "deploy": {"attention_replicas": A, "attention_tp": 1, "expert_ranks": E,
                          "micro_batches": m},
               "batch": B, "input_len": PROMPT, "output_len": DECODE,
               "decode_iteration_s": statistics.median(xs), "samples_s": xs,
               "source": f"perf/validate/measure_runtime_runs.py ({A + E} ranks on {os.cpu_count()} cores), "
                         f"{date}, load average {os.getloadavg()[0]:.1f}"}
        with open(os.path.join(a.out_dir, name + ".json"), "w") as f:
            json.dump(row, f, indent=1)
        print(f"{name:<22}{1e3 * row['decode_iteration_s']:>20.1f}")
    print(f"wrote {len(samples)} runs to {a.out_dir}")
    if a.in_situ:
        cis.fit_and_write(attn, expert, a.profile or cis.PROFILE,
                          f"perf/validate/measure_runtime_runs.py --in-situ --repeats {a.repeats}, batches "
                          f"{','.join(map(str, cal_batches))}, interleaved with the validation runs")


if __name__ == "__main__":
    main()
