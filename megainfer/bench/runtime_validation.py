"""The performance model's decode iteration against recorded runtime runs
(``perf/validate/validate_perfmodel.py``; the runs: ``perf/validate/measure_runtime_runs.py`` ->
``perf/results/runtime_runs/*.json``), with an ablation that leaves out one node term at a time."""
from __future__ import annotations

import dataclasses
import json
import statistics

from megainfer.perfmodel.model.hardware import NodeProfile, load_hardware
from megainfer.perfmodel.model.layer_times import FittedTimes, RooflineTimes
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.shapes import ModelShape

from .shapes import load_shape


def err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


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
