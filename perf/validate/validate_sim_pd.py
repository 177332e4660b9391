"""The PD job simulator (megainfer/perfmodel/sim/pd.py) against the recorded PD runs.

    python perf/validate/validate_sim_pd.py [--roofline] [--conditions auto|load|split|scale] [--no-idle]
                                   [--prompt-host] [--profile cpu_node] [--out F]

Reads ``perf/results/bench_pd*.json`` (``perf/bench/bench_pd.py``: bench50m dummy weights, requests at
t = 0, P prefill + A attention + E expert ranks and its AE baseline on the same ranks) and
simulates each row: the baseline with ``job_sim.simulate_job``, PD with ``pd_sim.simulate_pd_job``
(one loop) and ``goodput.simulate_pd_composed`` beside it. Prints measured vs simulated TTFT p50
and TPOT p50, their errors, the PD / baseline ratios' errors and how far each figure lies outside
its launches' range (a run's figure is the median over its launches, measured and simulated);
summaries over all runs, the probed ones and the quiet ones (``is_quiet``), with the launches'
own spread; writes ``perf/results/validate_sim_pd.json``.

Layer times: bench50m's in-situ fits (``perf/validate/calibrate_bench50m.py`` →
``perf/results/bench50m_in_situ.json``: decode attention, prefill-chunk attention, experts) at
the reference speed; ``ChunkTimes`` gives micro-batches of more than ``max_num_seqs`` tokens and
the prefill replicas (``PrefillPool(times=)``) the chunk fit. ``--roofline``: the datasheet
roofline instead (3-10x too fast).

The machine: a run recorded with ``bench_pd.py --calibrate`` has a probe before each launch and
after the last; each launch is simulated under its probes' conditions
(``megainfer.bench.pd_runs.conditions``): ``load``, the background load their prefill spans' slowdown
implies; ``split``, that for the PD prefill ranks and the decode spans' for the AE pipelines;
``scale``, a time scale; ``auto`` (default), ``load`` where other tenants ran (``others_ran``),
else ``scale``. A run without probes gets background load max(0, load average - ranks)
(``perf/results/pd_load_average.json`` or the file's ``load_average``), else none.

Runtime behaviour read off the runs: ``idle_decode_busy``, the median decode ranks' CPU share
over long-prompt PD launches (``pd_trace_stats.decode_cpu_share``) for runs before ``IDLE_FIX``
(their idle pool stepped empty iterations), 0 after (``--no-idle``: 0 for all); the prefill
rank's host work per (prompt, layer) beyond the fits, from short-prompt PD launches' CPU time,
used only with ``--prompt-host``. Traced runs (``--trace``) get their measured parts (prefill
step, decode and chunk iterations) beside the simulated ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
import calibrate_bench50m as cb  # noqa: E402
import pd_trace_stats as pts  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402

from megainfer.bench.shapes import BENCH50M_SHAPE as BENCH50M  # noqa: E402
from megainfer.bench.pd_runs import (IDLE_FIX, beyond, conditions, host_terms, is_quiet,  # noqa: E402
                                     others_ran, sleeps_when_idle, stats, with_spans)
from megainfer.perfmodel.model.chunk_times import ChunkTimes  # noqa: E402
from megainfer.perfmodel.sim.events import Requests  # noqa: E402
from megainfer.perfmodel.plan.goodput import PrefillPool, decode_model, simulate_pd_composed  # noqa: E402
from megainfer.perfmodel.model.hardware import LayerFit, load_hardware, with_background_load  # noqa: E402
from megainfer.perfmodel.sim.job import JobConfig, simulate_job  # noqa: E402
from megainfer.perfmodel.model.layer_times import FittedTimes  # noqa: E402
from megainfer.perfmodel.model.disagg import Plan, Workload  # noqa: E402
from megainfer.perfmodel.sim.pd import simulate_pd_job  # noqa: E402
from megainfer.perfmodel.plan.world_plan import _slots  # noqa: E402

WORKLOADS = {"long_prompt": ("long_prompt", "long_output"), "short_prompt": ("short_prompt", "short_output")}
MAX_SEQS, MAX_TOKENS = 16, 512  # perf/bench/bench_pd.py's scheduler
METRICS = ("ttft_p50_ms", "tpot_p50_ms")
KINDS = ("baseline", "pd_one_loop", "pd_composed")


def layer_times(hw, shape, fits: dict | None, speed: float):
    """(attention, expert, prefill) times of ``shape``: the fits scaled by ``speed``, or (None)
    the profile's roofline."""
    if fits is None:
        return None
    lf = {k: LayerFit(**{n: f[n] * (speed if n.startswith("k") else 1) for n in ("k1", "k1_ctx", "k2", "k3", "k4")},
                      dtype="float32") for k, f in fits.items()}
    dec, pre = FittedTimes(hw, shape, lf["decode"]), FittedTimes(hw, shape, lf["prefill"])
    return ChunkTimes(dec, pre, MAX_SEQS), dec, pre


def prompt_host_estimate(benches: dict, fits: dict, hw) -> tuple[float, list]:
    """Host seconds per (prompt, layer) of a PD prefill step beyond its layers: from every
    launch with per-rank CPU times (``cpu_s``) whose short-prompt job is one prefill step (the
    prefill rank then sleeps until STOP), (its CPU seconds - the step's fitted layer times) /
    (layers x prompts)."""
    from megainfer.perfmodel.sim.pd_parts import Prefill
    out = []
    pool = PrefillPool(BENCH50M, hw, 1, 1, "float32", times=layer_times(hw, BENCH50M, fits, 1.0)[2])
    for d in benches.values():
        a = d["args"]
        n, P = a["num"], a["short_prompt"]
        if n * P > MAX_TOKENS:
            continue
        # the step's fitted layer times: the same for every launch of this file
        ta, te = Prefill(pool, np.full((BENCH50M.num_layers, BENCH50M.num_experts), 1 / BENCH50M.num_experts),
                         np.random.default_rng(0)).step_s(n * P, (P + 1) / 2, n, n)
        for row in d["rows"]:
            if row["layout"] != "pd" or row["workload"] != "short_prompt":
                continue
            for r in row.get("runs", []):
                cpu = [c for k, c in (r.get("cpu_s") or []) if k == "prefill"]
                if cpu:
                    out.append((cpu[0] - ta - te) / (BENCH50M.num_layers * n))
    return (max(0.0, statistics.median(out)) if out else 0.0), out


def simulate_launch(a: dict, lay: dict, w: str, hw, fits, speed: float, idle: float = 0.0,
                    send: float = 0.0, hw_pre=None, overhead: float = 0.0) -> dict:
    """Baseline (``lay`` = the baseline layout) or PD (one loop and composed) of one launch;
    ``overhead``: host work per decode iteration (``JobConfig.iteration_overhead_s``)."""
    pk, ok = WORKLOADS[w]
    P, O, n = a[pk], a[ok], a["num"]
    reqs = Requests(np.zeros(n), np.full(n, P), np.full(n, O))
    wl = Workload(P, O)
    cfg = JobConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS, iteration_overhead_s=overhead)
    shp = _slots(BENCH50M, lay["E"])  # the runtime pads experts up to a multiple of the ranks
    plan = Plan(1, lay["A"], 1, lay["E"], a["m"], n, hw.name, hw.name)
    lt = layer_times(hw, shp, fits, speed)
    model = decode_model(shp, hw, hw, wl, "float32", True, times=lt and lt[:2])
    if not lay.get("P"):
        r = simulate_job(model, plan, reqs, cfg)
        it = np.array([(d, k) for _, d, k in r.iteration_s])
        return {"baseline": dict(summary(r.ttft_s, r.tpot_s),  # chunk: > max_num_seqs tokens
                                 chunk_iter_ms=float(np.mean(it[it[:, 1] > MAX_SEQS, 0])) * 1e3,
                                 decode_iter_ms=float(np.median(it[it[:, 1] <= MAX_SEQS, 0])) * 1e3)}
    pool = PrefillPool(BENCH50M, hw_pre or hw, lay["P"], lay.get("PTP", 1), "float32",
                       times=lt and FittedTimes(hw, BENCH50M, lt[2].fit), prompt_host_s=send * speed)
    one = simulate_pd_job(pool, model, plan, reqs, cfg, "float32", idle_decode_busy=idle)
    comp = simulate_pd_composed(pool, decode_model(shp, hw, hw, wl, "float32", True, float(P), lt and lt[:2]),
                                plan, reqs, cfg, "float32")
    diag = {"prefill_step_ms": float(np.mean([x[2] for x in one.prefill_steps])) * 1e3,
            "decode_iter_ms": float(np.median([d for _, d, _ in one.iteration_s])) * 1e3,
            "handoff_p50_ms": float(np.median(one.kv_ready_s - one.first_token_s)) * 1e3}
    return {"pd_one_loop": dict(summary(one.ttft_s, one.tpot_s), **diag),
            "pd_composed": summary(comp.ttft_s, comp.tpot_s)}


def summary(ttft, tpot) -> dict:
    return {"ttft_p50_ms": float(np.nanmedian(ttft)) * 1e3, "tpot_p50_ms": float(np.nanmedian(tpot)) * 1e3}


def simulate(d: dict, hw0, fits, speeds: list | None, bg: float, mode: str = "load", idle: float = 0.0,
             send: float = 0.0, overhead: float = 0.0) -> list[dict]:
    """Rows of one bench file: measured (median over launches), each kind's prediction (median
    over the launches' predictions, each under its ``conditions``, or all under background load
    ``bg`` without probes), errors and PD / baseline ratios."""
    a, lay = d["args"], d["layouts"]
    out = []
    for w in WORKLOADS:
        meas = {r["layout"]: r for r in d["rows"] if r["workload"] == w}
        row = {"workload": w, "prompt": a[WORKLOADS[w][0]], "output": a[WORKLOADS[w][1]], "requests": a["num"],
               "measured": {k: {m: meas[k][m] for m in METRICS + ("handoff_p50_ms",)} for k in ("baseline", "pd")}}
        for name in ("baseline", "pd"):
            runs = meas[name].get("runs") or [{"calibration": None}]
            cond = [{"speed": 1.0, "background_load": bg, "background_load_prefill": bg}
                    if r["calibration"] is None or speeds is None else
                    conditions(speeds[r["calibration"]], speeds[r["calibration"] + 1], hw0.node.cores, mode)
                    for r in runs]
            preds = [simulate_launch(a, lay[name], w, with_background_load(hw0, c["background_load"]), fits,
                                     c["speed"], idle, send, with_background_load(hw0, c["background_load_prefill"]),
                                     overhead)
                     for c in cond]
            row[f"conditions_{name}"] = cond
            if runs[0].get("spans"):  # traced: what the parts took, beside the simulator's
                st = [pts.step_stats(r["spans"], BENCH50M.num_layers, MAX_SEQS) for r in runs]
                row["measured"][name].update({k: statistics.median(x[k] for x in st)
                                              for k in st[0] if all(x[k] is not None for x in st)})
            for kind in preds[0]:
                row[kind] = {m: statistics.median(p[kind][m] for p in preds) for m in preds[0][kind]}
        spread = {k: {m: sorted(r[m] for r in meas[k].get("runs", [])) or [meas[k][m]] for m in METRICS}
                  for k in ("baseline", "pd")}
        row["launch_range"] = {k: {m: [v[0], v[-1]] for m, v in x.items()} for k, x in spread.items()}
        for kind, ref in (("baseline", "baseline"), ("pd_one_loop", "pd"), ("pd_composed", "pd")):
            row[f"{kind}_err"] = {m: row[kind][m] / row["measured"][ref][m] - 1 for m in METRICS}
            row[f"{kind}_beyond"] = {m: beyond(row[kind][m], *row["launch_range"][ref][m]) for m in METRICS}
        row["ratio_measured"] = {m: row["measured"]["pd"][m] / row["measured"]["baseline"][m] for m in METRICS}
        for kind in ("pd_one_loop", "pd_composed"):
            row[f"ratio_{kind}"] = {m: row[kind][m] / row["baseline"][m] for m in METRICS}
            row[f"ratio_{kind}_err"] = {m: row[f"ratio_{kind}"][m] / row["ratio_measured"][m] - 1 for m in METRICS}
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu_node")
    ap.add_argument("--roofline", action="store_true", help="the profile's roofline, no fit")
    ap.add_argument("--conditions", choices=("auto", "load", "split", "scale"), default="auto",
                    help="how a probed launch's slowdowns enter (megainfer.bench.pd_runs.conditions); "
                         "auto: load where other tenants ran (a launch's load average above the "
                         "job's ranks), else scale")
    ap.add_argument("--no-idle", action="store_true", help="idle_decode_busy = 0 (the decode pool "
                    "computes nothing while it has nothing to decode)")
    ap.add_argument("--prompt-host", action="store_true",
                    help="charge PD's prefill steps the per-prompt host work measured from the short-prompt "
                         "launches' CPU time (prompt_host_s; the baseline's job_sim has no such term)")
    ap.add_argument("--no-host", action="store_true", help="no host terms from the calibration runs "
                    "(the profile's wake-up latency, no host work per iteration)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "validate_sim_pd.json"))
    a = ap.parse_args()
    hw0 = load_hardware(a.profile)
    lp = os.path.join(RESULTS, "pd_load_average.json")
    loads = json.load(open(lp)) if os.path.isfile(lp) else {}
    paths = sorted(glob.glob(os.path.join(RESULTS, "bench_pd*.json")))
    benches = {os.path.basename(p): with_spans(p) for p in paths}
    with open(cb.OUT) as f:
        cals = json.load(f)["samples"]
    fits, cal_speeds = (None, None) if a.roofline else cb.reference_fits(cals)
    host = None if a.no_host else host_terms(cals, hw0)
    if host:  # the node's wake-up latency as the calibration runs saw it
        hw0 = dataclasses.replace(hw0, node=dataclasses.replace(hw0.node, wake_latency_s=host["wake_latency_s"]))
    print(f"host terms from the calibration runs: {host or 'none recorded (profile wake-up, no overhead)'}")
    spins = [pts.idle_decode_busy(r["spans"]) for d in benches.values() for row in d["rows"]
             if row["layout"] == "pd" for r in row.get("runs", []) if r.get("spans")]
    print(f"decode attention rank in spans while the PD pool has nothing to decode (traced runs): "
          f"{', '.join(f'{x:.2f}' for x in spins if x is not None)}")
    idles = [pts.decode_cpu_share(r) for n, d in benches.items() if not sleeps_when_idle(d)
             for row in d["rows"] if row["layout"] == "pd" and row["workload"] == "long_prompt"
             for r in row.get("runs", [])]
    idles = [x for x in idles if x is not None]
    idle = statistics.median(idles) if idles else 0.0
    send, sends = prompt_host_estimate(benches, fits, hw0) if fits else (0.0, [])
    print(f"prefill rank's host work per (prompt, layer) beyond its layers (short-prompt PD launches' "
          f"CPU time): {', '.join(f'{1e3 * x:.2f}' for x in sends)} ms (prompt_host_s{'' if a.prompt_host else ', not used'})")
    print(f"decode ranks' CPU share in long-prompt PD launches before {IDLE_FIX} (mostly idle; "
          f"cpu_s): {', '.join(f'{x:.2f}' for x in idles)}; median {idle:.2f} (idle_decode_busy "
          f"of those runs{', not used' if a.no_idle else ''}; later runs: 0, the pool sleeps)")
    speeds = {n: [cb.speed_of(c, fits) for c in d["calibrations"]] for n, d in benches.items()
              if d.get("calibrations") and fits}
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "profile": a.profile, "conditions": a.conditions, "layer_times": "roofline" if a.roofline else "in-situ fits (reference speed)",
           "fits": fits, "calibration_speeds": cal_speeds,
           "idle_decode_busy": {"runs": idles, "used": 0.0 if a.no_idle else idle, "attention_span_share": spins},
           "prompt_host_s": {"runs": sends, "used": send if a.prompt_host else 0.0},
           "host_terms": host, "runs": {}}
    print(f"{'run':<24}{'workload':<13}{'':<12}{'TTFT p50 ms':>12}{'err':>8}{'TPOT p50 ms':>12}{'err':>8}"
          f"   PD / baseline (TTFT, TPOT), ratio err")
    for name, d in benches.items():
        cal = name in speeds
        load = loads.get(name, d.get("load_average"))
        bg = 0.0 if cal or load is None else max(0.0, load - d["args"]["ranks"])
        u = 0.0 if a.no_idle or sleeps_when_idle(d) else idle
        mode = a.conditions if a.conditions != "auto" else "load" if others_ran(d) else "scale"
        rows = simulate(d, hw0, fits, speeds.get(name), bg, mode, u, send if a.prompt_host else 0.0,
                        host["iteration_overhead_s"] if host else 0.0)
        res["runs"][name] = {"measured_at": d.get("date"), "load_average": load, "background_load": bg,
                             "conditions": mode,
                             "calibration_speeds": speeds.get(name), "idle_decode_busy": u,
                             "rows": rows}
        for r in rows:
            for label, ref, kind in (("measured", "baseline", None), ("baseline sim", "baseline", "baseline"),
                                     ("measured", "pd", None), ("PD one loop", "pd", "pd_one_loop"),
                                     ("PD composed", "pd", "pd_composed")):
                v = r["measured"][ref] if kind is None else r[kind]
                e = ["" if kind is None else f"{100 * r[kind + '_err'][m]:+.0f}%" for m in METRICS]
                q = "" if ref == "baseline" else "   " + ", ".join(
                    f"{(r['ratio_measured'] if kind is None else r['ratio_' + kind])[m]:.2f}x" for m in METRICS)
                if kind not in (None, "baseline"):
                    q += "  " + ", ".join(f"{100 * r['ratio_' + kind + '_err'][m]:+.0f}%" for m in METRICS)
                print(f"{name:<24}{r['workload']:<13}{label + (' ' + ref if kind is None else ''):<12}"
                      f"{v['ttft_p50_ms']:12.1f}{e[0]:>8}{v['tpot_p50_ms']:12.1f}{e[1]:>8}{q}")
    res["summary"] = {}
    quiet = [n for n, d in benches.items() if is_quiet(d)]
    for scope, names in (("all runs", list(benches)), ("interleaved calibration", list(speeds)),
                         ("quiet machine", quiet)):
        rows = [r for n in names for r in res["runs"][n]["rows"]]
        if not rows:
            continue
        s = res["summary"][scope] = {}
        for kind in ("pd_one_loop", "pd_composed"):
            s[f"ratio_{kind}"] = stats([r[f"ratio_{kind}_err"][m] for r in rows for m in METRICS])
            s[f"absolute_{kind}"] = stats([r[f"{k}_err"][m] for r in rows for k in ("baseline", kind) for m in METRICS])
            out = [r[f"{k}_beyond"][m] for r in rows for k in ("baseline", kind) for m in METRICS]
            s[f"beyond_launches_{kind}"] = dict(stats(out), inside=float(np.mean(np.asarray(out) == 0)))
        dev = [max(abs(x / r["measured"][k][m] - 1) for x in r["launch_range"][k][m])
               for r in rows for k in ("baseline", "pd") for m in METRICS]
        s["launch_spread"] = stats(dev)  # a launch against its run's median: the measurement's own noise
        for k, v in s.items():
            print(f"{scope:<24} {k:<28} max |err| {100 * v['max_abs']:5.1f} %, median {100 * v['median_abs']:5.1f} % "
                  f"of {v['n']}" + (f" ({100 * v['inside']:.0f} % inside)" if "inside" in v else "")
                  + ("" if k == "launch_spread" else f" (goal 20 % / 10 %: {'met' if v['goal_met'] else 'NOT met'})"))
    write_json(a.out, res)


if __name__ == "__main__":
    main()
