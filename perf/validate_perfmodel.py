"""Validate the performance model on this machine.

Per layer: fit k1..k4 on one set of batch sizes, predict held-out batch sizes (and a held-out
context length), measured in the same run; the roofline from this run's matmul / memcpy rates
is printed beside it as the baseline.

Runtime: predicted vs measured decode iteration time of real runs (perf/pipeline_job.py, stored
in perf/results/runtime_runs/*.json; see validate_runtime for the fields), with the profile's
node terms; the model without them is the baseline, and an ablation leaves out one term at a time.

  python perf/validate_perfmodel.py [--quick] [--runtime-only] [--runtime-results FILE...]
Writes perf/results/validate_perfmodel.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import platform
import statistics
import sys

import torch
import yaml

import megainfer.conf
from megainfer.calibration.calibrate import matmul_flops, memcpy_bandwidth
from megainfer.perfmodel.model.fit import fit_attention, fit_line
from megainfer.perfmodel.model.hardware import LayerFit, NodeProfile, load_hardware, profile_from_dict
from megainfer.calibration.layer_bench import measure_layers
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.layer_times import FittedTimes, RooflineTimes
from megainfer.perfmodel.model.shapes import ModelShape

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_io import write_json  # noqa: E402


def load_shape(name: str) -> ModelShape:
    path = os.path.join(os.path.dirname(megainfer.conf.__file__), "plan_model", f"{name}.yaml")
    with open(path) as f:
        d = yaml.safe_load(f)
    return ModelShape.from_dict({k: v for k, v in d.items() if k != "name"}, d.get("name", name))


def err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


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


def validate_runtime(paths: list[str], hardware: str = "cpu_node") -> dict:
    """Predicted vs measured decode iteration time of real runtime runs.

    Each JSON (one run) needs: "model" (a conf/plan_model preset name, or a dict of the shape
    numbers), "deploy": {"attention_replicas", "attention_tp", "expert_ranks", "micro_batches"},
    "batch" (sequences decoding per iteration, all replicas), "input_len", "output_len" and
    "decode_iteration_s" (median measured decode iteration wall time). The prediction is
    DisaggModel.predict(...).t_iter with this machine's calibrated profile, all ranks on one node
    (the profile's node section: core sharing, contention, host overhead per hop, wake-up
    latency). The same model without the node section (kernel fits + link only) is the baseline.
    """
    hw = load_hardware(hardware)
    n = hw.node
    variants = {  # ablation: the model with one node term left out at a time
        "bare": NodeProfile(),
        "no_core_sharing": dataclasses.replace(n, cores=0),
        "no_contention": dataclasses.replace(n, contention={}),
        "no_host_overhead": dataclasses.replace(n, hop_overhead_s={}),
        "no_wake_latency": dataclasses.replace(n, wake_latency_s=0.0)}
    profiles = {"node": hw, **{k: dataclasses.replace(hw, node=v) for k, v in variants.items()}}
    rows = []
    for p in paths:
        with open(p) as f:
            run = json.load(f)
        m = run["model"]
        shape = load_shape(m) if isinstance(m, str) else ModelShape.from_dict(
            {k: v for k, v in m.items() if k != "name"}, m.get("name", "model"))
        dep = run["deploy"]
        plan = Plan(dep["attention_tp"], dep["attention_replicas"], 1, dep["expert_ranks"],
                    dep["micro_batches"], run["batch"])  # ranks_per_node=0: all on this node
        preds = {}
        for name, prof in profiles.items():
            times = FittedTimes(prof, shape, prof.fits[shape.name]) if shape.name in prof.fits else \
                RooflineTimes(prof, shape, "float32")
            model = DisaggModel(shape, times, times, Workload(run["input_len"], run["output_len"]), "float32")
            preds[name] = model.predict(plan)
            if name == "node":  # the node terms that prediction used, for the table
                h_a, h_e, d_a, d_e = model.plan_node_terms(plan)
        pred, base = preds["node"], preds["bare"]
        meas = run["decode_iteration_s"]
        rows.append({"file": p, "plan": plan.label(), "m": plan.m, "batch": plan.batch,
                     "measured_s": meas, "predicted_s": pred.t_iter, "err": err(pred.t_iter, meas),
                     "baseline_s": base.t_iter, "baseline_err": err(base.t_iter, meas),
                     "t_a": pred.t_a, "t_e": pred.t_e, "t_c": pred.t_c, "host_a": h_a, "host_e": h_e,
                     "dilation_a": d_a, "dilation_e": d_e,
                     "ablation_err": {k: err(preds[k].t_iter, meas) for k in variants}})
    print(f"{'plan':<20}{'m':>2}{'B':>5}{'measured':>10}{'model':>9}{'err':>8}{'no-node':>9}{'err':>8}"
          f"{'T_a':>7}{'T_e':>7}{'T_c':>6}{'dil_a':>6}{'dil_e':>6}   (ms)")
    for r in rows:
        print(f"{r['plan']:<20}{r['m']:>2}{r['batch']:>5}{r['measured_s'] * 1e3:10.2f}"
              f"{r['predicted_s'] * 1e3:9.2f}{r['err']:+8.1%}{r['baseline_s'] * 1e3:9.2f}"
              f"{r['baseline_err']:+8.1%}{r['t_a'] * 1e3:7.2f}{r['t_e'] * 1e3:7.2f}{r['t_c'] * 1e3:6.2f}"
              f"{r['dilation_a']:6.2f}{r['dilation_e']:6.2f}")
    summary = {}
    if rows:
        for key, col in (("", "err"), ("baseline_", "baseline_err")):
            e = [abs(r[col]) for r in rows]
            summary.update({f"{key}max_abs_err": max(e), f"{key}median_abs_err": statistics.median(e)})
        summary["target_met"] = summary["max_abs_err"] < 0.20 and summary["median_abs_err"] < 0.10
        print(f"runtime: max |err| {summary['max_abs_err']:.1%}, median {summary['median_abs_err']:.1%} "
              f"(target 20% / 10%: {'met' if summary['target_met'] else 'NOT met'}); without the node "
              f"terms: max {summary['baseline_max_abs_err']:.1%}, median {summary['baseline_median_abs_err']:.1%}")
        summary["ablation"] = {}
        for k in variants:
            e = [abs(r["ablation_err"][k]) for r in rows]
            summary["ablation"][k] = {"max_abs_err": max(e), "median_abs_err": statistics.median(e)}
            print(f"  ablation {k:<18} max {max(e):6.1%}  median {statistics.median(e):6.1%}")
    return {"rows": rows, "summary": summary, "node": dataclasses.asdict(hw.node)}


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
        a.runtime_results = sorted(glob.glob(os.path.join(HERE, "results", "runtime_runs", "*.json")))
    if a.runtime_results:
        out["runtime"] = validate_runtime(a.runtime_results, a.hardware)
    else:
        print("runtime validation: no --runtime-results given and none in perf/results/runtime_runs/")
    write_json(os.path.join(HERE, "results", "validate_perfmodel.json"), out)


if __name__ == "__main__":
    sys.exit(main())
