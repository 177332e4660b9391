"""The PD job simulator (megainfer/perfmodel/pd_sim.py) against the recorded PD runs.

    python perf/validate_sim_pd.py [--profile cpu_node]

Reads ``perf/results/bench_pd*.json`` (``perf/bench_pd.py``: bench50m dummy weights, all
requests at t = 0, a PD layout of P prefill + A attention + E expert ranks and its AE baseline
on the same ranks) and simulates each row's job: the baseline with ``job_sim.simulate_job``,
the PD layout with ``pd_sim.simulate_pd_job`` (one event loop) and with the composed model
(``goodput.simulate_pd_composed``) beside it. Prints measured vs simulated TTFT p50, TPOT p50
and the PD / baseline ratios, and writes ``perf/results/validate_sim_pd.json``. The profile is
the calibrated CPU one; bench50m has no calibrated layer fit there, so its layer times are
the profile's roofline (absolute times are expected to be low: docs/perfmodel.md,
"Validation"), and what the comparison can check is where PD moves TTFT and TPOT.

Other tenants' threads time-share the cores with the job's ranks (``node.background_load``):
where ``perf/results/pd_load_average.json`` ({result file: 1-min load average read around
its run}) has the run, it is simulated with background load = max(0, load - ranks) (the
load average counts the run's own ranks too), else with none.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_io import write_json  # noqa: E402

from megainfer.perfmodel.events import Requests  # noqa: E402
from megainfer.perfmodel.goodput import PrefillPool, decode_model, simulate_pd_composed  # noqa: E402
from megainfer.perfmodel.hardware import load_hardware, with_background_load  # noqa: E402
from megainfer.perfmodel.job_sim import JobConfig, simulate_job  # noqa: E402
from megainfer.perfmodel.model import Plan, Workload  # noqa: E402
from megainfer.perfmodel.pd_sim import simulate_pd_job  # noqa: E402
from megainfer.perfmodel.shapes import ModelShape  # noqa: E402
from megainfer.perfmodel.world_plan import _slots  # noqa: E402

BENCH50M = ModelShape("bench50m", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                      head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=768, vocab_size=8192)
WORKLOADS = {"long_prompt": ("long_prompt", "long_output"), "short_prompt": ("short_prompt", "short_output")}


def simulate(d: dict, hw) -> list[dict]:
    a, lay = d["args"], d["layouts"]
    cfg = JobConfig(max_num_seqs=16, max_num_batched_tokens=512)
    out = []
    for w, (pk, ok) in WORKLOADS.items():
        P, O, n = a[pk], a[ok], a["num"]
        reqs = Requests(np.zeros(n), np.full(n, P), np.full(n, O))
        wl = Workload(P, O)
        meas = {r["layout"]: r for r in d["rows"] if r["workload"] == w}
        b, p = lay["baseline"], lay["pd"]
        padded = _slots(BENCH50M, b["E"])  # the runtime pads experts up to a multiple of the ranks
        base = simulate_job(decode_model(padded, hw, hw, wl, "float32", True), Plan(1, b["A"], 1, b["E"], a["m"], n, hw.name, hw.name), reqs, cfg)
        dplan = Plan(1, p["A"], 1, p["E"], a["m"], n, hw.name, hw.name)
        model = decode_model(_slots(BENCH50M, p["E"]), hw, hw, wl, "float32", True)
        pool = PrefillPool(BENCH50M, hw, p["P"], 1, "float32")
        one = simulate_pd_job(pool, model, dplan, reqs, cfg, "float32")
        comp = simulate_pd_composed(pool, decode_model(_slots(BENCH50M, p["E"]), hw, hw, wl, "float32", True, float(P)),
                                    dplan, reqs, cfg, "float32")
        row = {"workload": w, "prompt": P, "output": O, "requests": n}
        for name, ttft, tpot in (("baseline", base.ttft_s, base.tpot_s), ("pd_one_loop", one.ttft_s, one.tpot_s),
                                 ("pd_composed", comp.ttft_s, comp.tpot_s)):
            row[name] = {"ttft_p50_ms": float(np.nanmedian(ttft)) * 1e3,
                         "tpot_p50_ms": float(np.nanmedian(tpot)) * 1e3}
        row["measured"] = {k: {"ttft_p50_ms": v["ttft_p50_ms"], "tpot_p50_ms": v["tpot_p50_ms"]}
                           for k, v in meas.items()}
        for src, bk, pk2 in (("measured", ("measured", "baseline"), ("measured", "pd")),
                             ("one_loop", ("baseline",), ("pd_one_loop",)),
                             ("composed", ("baseline",), ("pd_composed",))):
            bb = row[bk[0]][bk[1]] if len(bk) == 2 else row[bk[0]]
            pp = row[pk2[0]][pk2[1]] if len(pk2) == 2 else row[pk2[0]]
            row[f"pd_over_baseline_{src}"] = {m: pp[m] / bb[m] for m in ("ttft_p50_ms", "tpot_p50_ms")}
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu_node")
    a = ap.parse_args()
    hw0 = load_hardware(a.profile)
    lp = os.path.join(HERE, "results", "pd_load_average.json")
    loads = json.load(open(lp)) if os.path.isfile(lp) else {}
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "profile": a.profile, "runs": {}}
    print(f"{'run':<22} {'workload':<13} {'':<10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12}   "
          f"PD / baseline (TTFT, TPOT)")
    for path in sorted(glob.glob(os.path.join(HERE, "results", "bench_pd*.json"))):
        with open(path) as f:
            d = json.load(f)
        load = loads.get(os.path.basename(path))
        bg = 0.0 if load is None else max(0.0, load - d["args"]["ranks"])
        rows = simulate(d, with_background_load(hw0, bg))
        res["runs"][os.path.basename(path)] = {"measured_at": d.get("date"), "load_average": load,
                                               "background_load": bg, "rows": rows}
        for r in rows:
            for label, key, ratio in (("measured", ("measured", "pd"), "measured"),
                                      ("one loop", ("pd_one_loop",), "one_loop"),
                                      ("composed", ("pd_composed",), "composed")):
                v = r[key[0]][key[1]] if len(key) == 2 else r[key[0]]
                q = r[f"pd_over_baseline_{ratio}"]
                print(f"{os.path.basename(path):<22} {r['workload']:<13} {label:<10} {v['ttft_p50_ms']:12.1f} "
                      f"{v['tpot_p50_ms']:12.1f}   {q['ttft_p50_ms']:.2f}x, {q['tpot_p50_ms']:.2f}x")
    errs = {src: [r[f"pd_over_baseline_{src}"][k] / r["pd_over_baseline_measured"][k] - 1
                  for run in res["runs"].values() for r in run["rows"] for k in ("ttft_p50_ms", "tpot_p50_ms")]
            for src in ("one_loop", "composed")}
    res["ratio_error"] = {src: {"max_abs": float(np.max(np.abs(e))), "median_abs": float(np.median(np.abs(e)))}
                          for src, e in errs.items()}
    for src, e in res["ratio_error"].items():
        print(f"PD / baseline ratio error, {src}: max |err| {100 * e['max_abs']:.1f} %, median "
              f"{100 * e['median_abs']:.1f} % (goal: 20 % / 10 %)")
    write_json(os.path.join(HERE, "results", "validate_sim_pd.json"), res)


if __name__ == "__main__":
    main()
