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
from megainfer.perfmodel.hardware import load_hardware  # noqa: E402
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
    hw = load_hardware(a.profile)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "profile": a.profile, "runs": {}}
    print(f"{'run':<22} {'workload':<13} {'':<10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12}   "
          f"PD / baseline (TTFT, TPOT)")
    for path in sorted(glob.glob(os.path.join(HERE, "results", "bench_pd*.json"))):
        with open(path) as f:
            d = json.load(f)
        rows = simulate(d, hw)
        res["runs"][os.path.basename(path)] = {"measured_at": d.get("date"), "rows": rows}
        for r in rows:
            for label, key, ratio in (("measured", ("measured", "pd"), "measured"),
                                      ("one loop", ("pd_one_loop",), "one_loop"),
                                      ("composed", ("pd_composed",), "composed")):
                v = r[key[0]][key[1]] if len(key) == 2 else r[key[0]]
                q = r[f"pd_over_baseline_{ratio}"]
                print(f"{os.path.basename(path):<22} {r['workload']:<13} {label:<10} {v['ttft_p50_ms']:12.1f} "
                      f"{v['tpot_p50_ms']:12.1f}   {q['ttft_p50_ms']:.2f}x, {q['tpot_p50_ms']:.2f}x")
    write_json(os.path.join(HERE, "results", "validate_sim_pd.json"), res)


if __name__ == "__main__":
    main()
