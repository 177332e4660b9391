"""Validate the performance model on this machine.

Per layer: fit k1..k4 on one set of batch sizes, predict held-out batch sizes (and a held-out
context length), measured in the same run; the roofline from this run's matmul / memcpy rates
is printed beside it as the baseline.

Runtime: predicted vs measured decode iteration time of real runs (perf/jobs/pipeline_job.py, stored
in perf/results/runtime_runs/*.json; see validate_runtime for the fields), with the profile's
node terms; the model without them is the baseline, and an ablation leaves out one term at a time.

  python perf/validate/validate_perfmodel.py [--quick] [--runtime-only] [--runtime-results FILE...]
Writes perf/results/validate_perfmodel.json.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import platform
import statistics
import sys

import torch

from megainfer.calibration.calibrate import matmul_flops, memcpy_bandwidth
from megainfer.perfmodel.model.fit import fit_attention, fit_line
from megainfer.perfmodel.model.hardware import LayerFit, profile_from_dict
from megainfer.calibration.layer_bench import measure_layers
from megainfer.perfmodel.model.layer_times import FittedTimes, RooflineTimes
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.bench.results_io import write_json
from megainfer.bench.runtime_validation import err, validate_runtime
from megainfer.bench.shapes import load_shape

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402



def validate_layers(shape: ModelShape, quick: bool) -> dict:
    torch.set_num_threads(1)
    fit_b = (1, 2, 4, 8, 16, 32, 64)
    held_b = (3, 6, 12, 24, 48)
    ctxs, held_ctx = (128, 512), 256
    experts = shape.num_experts // 2
    # one interleaved measurement of every point; fit on fit_b x ctxs, predict the rest
    allm = measure_layers(shape, sorted(fit_b + held_b), ctxs + (held_ctx,), experts,
                          rounds=2 if quick else 5, repeats=1 if quick else 3)
    fit = {"attention": [x for x in allm["attention"] if x[0] in fit_b and x[1] in ctxs],
           "expert": [x for x in allm["expert"] if x[0] in fit_b]}
    held = {"attention": [x for x in allm["attention"] if x[0] in held_b or x[1] == held_ctx],
            "expert": [x for x in allm["expert"] if x[0] in held_b]}
    k1, k1c, k2 = fit_attention(*zip(*fit["attention"]), relative=True)
    k3, k4 = fit_line(*zip(*fit["expert"]), relative=True)
    lf = LayerFit(k1=k1, k2=k2, k3=k3, k4=k4, k1_ctx=k1c, dtype="float32")
    hw = profile_from_dict({"name": "this_run", "matmul_flops": {"float32": matmul_flops()},
                            "mem_bw_Bps": memcpy_bandwidth(), "mem_bytes": 1e10,
                            "inter_link": {"latency_s": 5e-6, "bandwidth_Bps": 5e9},
                            "price_per_hour": 0.0, "matmul_efficiency": 1.0, "mem_efficiency": 1.0,
                            "kernel_overhead_s": 0.0})
    fitted, roof = FittedTimes(hw, shape, lf), RooflineTimes(hw, shape, "float32")
    rows = []
    for b, c, t in held["attention"]:
        rows.append({"kind": "attention", "b": b, "ctx": c, "measured_s": t,
                     "fit_s": fitted.t_attn(b, c), "roofline_s": roof.t_attn(b, c)})
    for b, t in held["expert"]:
        rows.append({"kind": "expert", "b": b, "ctx": None, "measured_s": t,
                     "fit_s": fitted.t_expert([b]), "roofline_s": roof.t_expert([b])})
    for r in rows:
        r["fit_err"] = err(r["fit_s"], r["measured_s"])
        r["roofline_err"] = err(r["roofline_s"], r["measured_s"])
    print(f"{'kind':<10}{'b':>4}{'ctx':>6}{'measured ms':>13}{'fit ms':>9}{'err':>8}"
          f"{'roofline ms':>13}{'err':>8}")
    for r in rows:
        print(f"{r['kind']:<10}{r['b']:>4}{str(r['ctx'] or '-'):>6}{r['measured_s'] * 1e3:13.3f}"
              f"{r['fit_s'] * 1e3:9.3f}{r['fit_err']:8.1%}{r['roofline_s'] * 1e3:13.3f}"
              f"{r['roofline_err']:8.1%}")
    fe = [abs(r["fit_err"]) for r in rows]
    re_ = [abs(r["roofline_err"]) for r in rows]
    summary = {"fit_max_abs_err": max(fe), "fit_median_abs_err": statistics.median(fe),
               "roofline_max_abs_err": max(re_), "roofline_median_abs_err": statistics.median(re_)}
    print(f"held-out per-layer error: fit max {summary['fit_max_abs_err']:.1%} median "
          f"{summary['fit_median_abs_err']:.1%} | roofline (baseline) max "
          f"{summary['roofline_max_abs_err']:.1%} median {summary['roofline_median_abs_err']:.1%}")
    return {"fit": vars(lf), "matmul_flops": hw.matmul_flops["float32"], "mem_bw_Bps": hw.mem_bw_Bps,
            "fit_points": fit, "rows": rows, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="cpu_small")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and repeats")
    ap.add_argument("--runtime-results", nargs="*", default=None,
                    help="runtime run JSONs (default: perf/results/runtime_runs/*.json)")
    ap.add_argument("--runtime-only", action="store_true", help="skip the per-layer validation")
    ap.add_argument("--hardware", default="cpu_node")
    a = ap.parse_args()
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "cpu_count": os.cpu_count(), "load_average": os.getloadavg()},
           "model": a.model, "note": "machine shared with other helpers; layer times are thread "
                                     "CPU time (one torch thread), medians over interleaved rounds"}
    if not a.runtime_only:
        out["layers"] = validate_layers(load_shape(a.model), a.quick)
    if a.runtime_results is None:
        a.runtime_results = sorted(glob.glob(os.path.join(RESULTS, "runtime_runs", "*.json")))
    if a.runtime_results:
        out["runtime"] = validate_runtime(a.runtime_results, a.hardware)
    else:
        print("runtime validation: no --runtime-results given and none in perf/results/runtime_runs/")
    write_json(os.path.join(RESULTS, "validate_perfmodel.json"), out)


if __name__ == "__main__":
    sys.exit(main())
