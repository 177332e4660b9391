"""The PD simulator's prediction of ``perf/bench/bench_pd_offload.py``'s runs (plain PD and PD +
offload on 1 prefill + 1 decode attention + 2 expert ranks, bench50m), calibrated as
``perf/validate/validate_sim_pd.py`` calibrates the PD bench's runs.

    python perf/validate/predict_pd_offload.py [--result perf/results/bench_pd_offload.json]
                                               [--profile cpu_node]

(re)writes the result's ``simulator`` field; ``bench_pd_offload.py`` calls ``predict`` itself.

Each launch is simulated with ``sim.pd.simulate_pd_job`` under the conditions of the probes beside
it (``--calibrate``; ``megainfer.bench.pd_runs.conditions``, ``auto``: background load where other
tenants ran, else a time scale; a launch without probes: background load = its load average -
4 ranks): bench50m's in-situ layer fits (``perf/results/bench50m_in_situ.json``, decode
attention, prefill chunks, experts) at the probes' speed, the host terms of those calibration
runs, the decode pool's KV (``decode_kv_tokens`` = blocks x block size, a whole-life reservation)
and with offload ``Offload(1, offload_blocks, block_size)``. Figures per layout: the largest
decode batch, tokens/s (output tokens / job seconds), the mean per-layer round trip
(``PdJobResult.round_trip_s``), TPOT p50, requests offloaded; medians over the launches'
predictions, and measured / predicted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
import calibrate_bench50m as cb  # noqa: E402
from validate_sim_pd import layer_times  # noqa: E402
from megainfer.bench.pd_runs import conditions, host_terms, others_ran  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402
from megainfer.bench.shapes import BENCH50M_SHAPE as BENCH50M  # noqa: E402
from megainfer.perfmodel.model.disagg import Plan, Workload  # noqa: E402
from megainfer.perfmodel.model.hardware import load_hardware, with_background_load  # noqa: E402
from megainfer.perfmodel.model.layer_times import FittedTimes  # noqa: E402
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model  # noqa: E402
from megainfer.perfmodel.plan.world_plan import _slots  # noqa: E402
from megainfer.perfmodel.sim.events import Requests  # noqa: E402
from megainfer.perfmodel.sim.job import JobConfig  # noqa: E402
from megainfer.perfmodel.sim.pd import simulate_pd_job  # noqa: E402
from megainfer.perfmodel.sim.pd_offload import Offload  # noqa: E402

RANKS, EXPERT_RANKS = 4, 2
FIGURES = ("max_batch", "tokens_per_s", "round_trip_ms", "tpot_p50_ms", "offloaded")


def simulate_launch(c: dict, offload: bool, hw, hw_pre, fits: dict, speed: float,
                    overhead: float) -> dict:
    """One launch of layout ``offload`` of the bench config ``c`` (``bench_pd_offload.py``'s
    ``config``) on ``hw`` (decode side) and ``hw_pre`` (the prefill rank), layer times at
    ``speed``, ``overhead`` host seconds per iteration."""
    n, P, O = c["num"], c["prompt_len"], c["output_len"]
    shp = _slots(BENCH50M, EXPERT_RANKS)  # the runtime pads experts up to a multiple of the ranks
    plan = Plan(1, 1, 1, EXPERT_RANKS, c["m"], n, hw.name, hw.name)
    lt = layer_times(hw, shp, fits, speed)
    model = decode_model(shp, hw, hw, Workload(P, O), "float32", True, times=lt[:2])
    pool = PrefillPool(BENCH50M, hw_pre, 1, 1, "float32", times=FittedTimes(hw, BENCH50M, lt[2].fit))
    cfg = JobConfig(max_num_seqs=c["max_num_seqs"], max_num_batched_tokens=c["max_num_batched_tokens"],
                    iteration_overhead_s=overhead)
    off = Offload(1.0, c["offload_blocks"], c["block_size"]) if offload else Offload()
    r = simulate_pd_job(pool, model, plan, Requests(np.zeros(n), np.full(n, P), np.full(n, O)), cfg,
                        "float32", offload=off, decode_kv_tokens=c["num_blocks"] * c["block_size"])
    return dict(max_batch=max(x[2] for x in r.iteration_s), tokens_per_s=r.throughput_tok_s,
                round_trip_ms=1e3 * float(r.round_trip_s.mean()) if len(r.round_trip_s) else None,
                tpot_p50_ms=1e3 * float(np.nanmedian(r.tpot_s)), offloaded=int(r.offloaded.sum()))


def launch_conditions(result: dict, run: dict, speeds: list | None, cores: int) -> dict:
    """A launch's machine: from the probes before and after it (``pd_runs.conditions``, ``auto``:
    ``load`` where the run's launches saw other tenants, else ``scale``), or, unprobed, its load
    average less the job's ranks as background load."""
    loads = [{"load_average": r.get("load_average")} for v in result["runs"].values() for r in v]
    if speeds is not None and run.get("calibration") is not None:
        mode = "load" if others_ran({"rows": loads, "args": {"ranks": RANKS}}) else "scale"
        k = run["calibration"]
        return dict(conditions(speeds[k], speeds[k + 1], cores, mode), mode=mode)
    bg = max(0.0, (run.get("load_average") or RANKS) - RANKS)
    return dict(speed=1.0, background_load=bg, background_load_prefill=bg, mode="unprobed")


def predict(result: dict, profile: str = "cpu_node") -> dict:
    """The ``simulator`` field of a ``bench_pd_offload.py`` result: per layout the median over
    its launches' predictions, the measured / predicted ratios, and how it was calibrated."""
    hw0 = load_hardware(profile)
    with open(cb.OUT) as f:
        cals = json.load(f)["samples"]
    fits, _ = cb.reference_fits(cals)
    host = host_terms(cals, hw0)
    if host:  # the node's wake-up latency as the calibration runs saw it
        hw0 = dataclasses.replace(hw0, node=dataclasses.replace(hw0.node, wake_latency_s=host["wake_latency_s"]))
    overhead = host["iteration_overhead_s"] if host else 0.0
    probes = result.get("calibrations") or []
    speeds = [cb.speed_of(p, fits) for p in probes] if probes else None
    out = {"profile": profile, "layer_times": "bench50m in-situ fits (perf/results/bench50m_in_situ.json)",
           "host_terms": host, "rows": {}, "measured_over_predicted": {}, "conditions": {}}
    for name, runs in result["runs"].items():
        conds = [launch_conditions(result, r, speeds, hw0.node.cores) for r in runs]
        preds = [simulate_launch(result["config"], name == "pd_offload",
                                 with_background_load(hw0, c["background_load"]),
                                 with_background_load(hw0, c["background_load_prefill"]),
                                 fits, c["speed"], overhead) for c in conds]
        row = {k: (statistics.median(v) if v else None)
               for k in FIGURES for v in [[p[k] for p in preds if p[k] is not None]]}
        out["rows"][name], out["conditions"][name] = row, conds
        meas = result["rows"][name]
        out["measured_over_predicted"][name] = {
            k: meas[k] / row[k] for k in ("max_batch", "tokens_per_s", "round_trip_ms")
            if meas.get(k) is not None and row[k]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--result", default=os.path.join(RESULTS, "bench_pd_offload.json"))
    ap.add_argument("--profile", default="cpu_node")
    a = ap.parse_args()
    with open(a.result) as f:
        result = json.load(f)
    result["simulator"] = predict(result, a.profile)
    for name, row in result["simulator"]["rows"].items():
        print(name, {k: v for k, v in row.items()}, result["simulator"]["measured_over_predicted"][name])
    write_json(a.result, result)


if __name__ == "__main__":
    main()
