"""The whole-job simulator (megainfer/perfmodel/sim/job.py) against the runtime on this machine.

For each workload x layout, the same requests (arrival time, prompt and output length) run in the
disaggregated runtime (perf/jobs/workload_job.py under mpiexec -n A+E, pipeline_bench shape, dummy
weights) and in the simulator fed this machine's calibrated profile; TTFT p50, TPOT p50 and
output tokens/s are compared, with the closed form (DisaggModel.predict: all requests at t = 0,
one prefill pass, balanced routing) beside them as the baseline.

    python perf/validate/validate_sim.py [--repeats 2] [--only w1_offline] [--predict-only]

Measuring: every repeat runs each (workload, layout) once (alternating order); before each run,
and after the last, one traced calibration run of perf/validate/calibrate_in_situ.py (1 attention + 1
expert rank, m = 1, a batch size from CAL_BATCHES that no validation run uses). All their spans
give one in-situ fit of the layer times (replacing conf/hardware/cpu_node.yaml's pipeline_bench
fit in memory; the file is not changed; the node section stays). The machine is shared and its
speed drifts by 2x within minutes, so each run's prediction scales that fit by the run's speed
factor: the median of measured / fitted over the spans of the calibration runs just before and
just after it (``speed_factor``); the closed form gets the same profile. The simulator with the
pooled fit alone is printed too. The measured metrics and the predictions are medians over
repeats. The simulator gets each run's request trace and the (token, expert) counts its routers
recorded per layer (Routing "load": a recorded load window).

Writes perf/results/validate_sim.json (runs and in-situ samples in perf/results/sim_validation/).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import sys
import tempfile

import numpy as np
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from mpi_launch import run_job  # noqa: E402
from pipeline_shape import BENCH_SHAPE  # noqa: E402

from megainfer.bench.results_io import write_json  # noqa: E402
from megainfer.bench.shapes import load_shape  # noqa: E402

from megainfer.bench.sim_validation import hop_gaps, host_terms, measured_summary, prefill_samples  # noqa: E402
from megainfer.perfmodel.sim.events import LengthDist, Routing, poisson_requests  # noqa: E402
from megainfer.perfmodel.model.hardware import hardware_dir, profile_from_dict  # noqa: E402
from megainfer.perfmodel.model.insitu import fit_in_situ, layer_samples  # noqa: E402
from megainfer.perfmodel.sim.closed_form import closed_form_job  # noqa: E402
from megainfer.perfmodel.sim.job import JobConfig, simulate_job  # noqa: E402
from megainfer.perfmodel.model.layer_times import FittedTimes  # noqa: E402
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload  # noqa: E402

MODEL = "pipeline_bench"
RUN_DIR = os.path.join(RESULTS, "sim_validation")
# name -> (requests, arrival rate /s (0: all at t = 0), prompt, output, router zipf bias)
WORKLOADS = {
    "w1_offline": (96, 0.0, LengthDist("fixed", 16), LengthDist("fixed", 12), 0.0),
    "w2_skewed": (96, 0.0, LengthDist("fixed", 16), LengthDist("fixed", 12), 2.0),
    "w3_arrivals": (64, 25.0, LengthDist("uniform", lo=8, hi=32), LengthDist("uniform", lo=4, hi=20), 0.0),
}
LAYOUTS = [(1, 2, 2), (2, 1, 2)]  # (attention replicas, expert ranks, micro-batches)
MAX_SEQS, MAX_TOKENS = 128, 512  # scheduler limits per replica, the same in runtime and simulator
METRICS = ("ttft_s_p50", "tpot_s_p50", "throughput_tok_s")
CAL_BATCHES = (16, 256, 64, 128)  # in-situ calibration runs, cycled (not the validation batches)


def requests_for(name: str):
    n, rate, p, o, _ = WORKLOADS[name]
    return poisson_requests(n, rate, p, o, seed=7)


def write_trace(req, path: str) -> None:
    with open(path, "w") as f:
        for a, p, o in zip(req.arrival_s, req.prompt_len, req.output_len):
            f.write(json.dumps({"arrival_s": float(a), "prompt_len": int(p), "output_len": int(o)}) + "\n")


def measure(names, repeats: int) -> None:
    """Each run is preceded by one traced calibration run (1 attention + 1 expert rank, m = 1,
    batch cycling through CAL_BATCHES) and the last is followed by one: run k's machine speed is
    read off calibrations k and k + 1, its neighbours in time."""
    import calibrate_in_situ as cis
    tmp = tempfile.mkdtemp(prefix="validate_sim_")
    os.makedirs(RUN_DIR, exist_ok=True)
    todo = [(w, lay) for w in names for lay in LAYOUTS]
    order = [x for rep in range(repeats) for x in (todo if rep % 2 == 0 else todo[::-1])]

    def calibrate(k):
        b = CAL_BATCHES[k % len(CAL_BATCHES)]
        trace = cis.traced_run(b, tmp)
        attn, expert = layer_samples(trace, cis.PROMPT, load_shape(MODEL).top_k)
        pa, pe = prefill_samples(trace, cis.PROMPT, load_shape(MODEL).top_k)
        print(f"  calibration {k}: b={b}, {len(attn) + len(pa)} attention, {len(expert) + len(pe)} expert spans",
              flush=True)
        hops, steps = hop_gaps(trace)
        write_json(os.path.join(RUN_DIR, f"cal_{k:03d}.json"),
                   {"batch": b, "attention": attn, "expert": expert, "prefill_attention": pa,
                    "prefill_expert": pe, "hops": hops, "step_gaps": steps}, quiet=True)

    seen = {}
    for k, (w, (A, E, m)) in enumerate(order):
        calibrate(k)
        rep = seen[(w, A, E, m)] = seen.get((w, A, E, m), -1) + 1
        trace = os.path.join(tmp, f"{w}.jsonl")
        write_trace(requests_for(w), trace)
        out = os.path.join(RUN_DIR, f"{w}_a{A}e{E}m{m}_r{rep}.json")
        run = run_job(A + E, "workload_job.py", os.path.join(tmp, "out.json"),
                      [trace, *BENCH_SHAPE, "--replicas", A, "--m", m, "--zipf", WORKLOADS[w][4],
                       "--max-num-seqs", MAX_SEQS, "--max-num-batched-tokens", MAX_TOKENS])
        run.update(workload=w, repeat=rep, seq=k, load_average=os.getloadavg()[0],
                   date=datetime.datetime.now().isoformat(timespec="seconds"))
        write_json(out, run, quiet=True)
        s = measured_summary(run)
        print(f"  {w} A{A}:E{E} m{m} rep {rep}: TTFT p50 {s['ttft_s_p50'] * 1e3:.0f} ms, TPOT p50 "
              f"{s['tpot_s_p50'] * 1e3:.0f} ms, {s['throughput_tok_s']:.0f} tok/s", flush=True)
    calibrate(len(order))


def _cal(k: int, prefill: bool) -> tuple[list, list, dict]:
    """Calibration run k's (attention, expert) samples (decode, plus prefill if asked) and all."""
    with open(os.path.join(RUN_DIR, f"cal_{k:03d}.json")) as f:
        d = json.load(f)
    keys = (("attention", "expert"),) + ((("prefill_attention", "prefill_expert"),) if prefill else ())
    attn = [tuple(x) for a, _ in keys for x in d[a]]
    return attn, [tuple(x) for _, e in keys for x in d[e]], d


def base_profile(prefill: bool) -> dict:
    """cpu_node (as a dict) with the in-situ pipeline_bench fit of all this validation's
    calibration runs: decode spans, and with ``prefill`` the prefill iterations' spans too."""
    with open(os.path.join(hardware_dir(), "cpu_node.yaml")) as f:
        d = yaml.safe_load(f)
    d.pop("defaults", None)
    ks = sorted(int(p[-8:-5]) for p in glob.glob(os.path.join(RUN_DIR, "cal_*.json")))
    attn = [x for k in ks for x in _cal(k, prefill)[0]]
    expert = [x for k in ks for x in _cal(k, prefill)[1]]
    d["fits"][MODEL] = {**d["fits"].get(MODEL, {}), **fit_in_situ(attn, expert, load_shape(MODEL).num_experts),
                        "dtype": "float32", "source": "in_situ"}
    return d


def conditions(prof: dict, seq: int, prefill: bool) -> dict:
    """The shared machine at run ``seq``, read off the calibration runs just before and after it:
    speed = median of measured / fitted over their spans (how much slower than the pooled fit);
    wake = median over their hops of (gap - the link's time for that message): the node's
    wake-up latency then; step = median gap between iterations - median hop: host work per
    iteration (sampling, scheduling, the next step's inputs)."""
    f, h = prof["fits"][MODEL], load_shape(MODEL)
    hw = profile_from_dict(json.loads(json.dumps(prof)), "cpu_node")
    r, hops, steps = [], [], []
    for k in (seq, seq + 1):
        attn, expert, d = _cal(k, prefill)
        r += [t / (f["k2"] + b * (f["k1"] + f["k1_ctx"] * c)) for b, c, t in attn]
        r += [t / (h.num_experts * f["k4"] + f["k3"] * p) for p, t in expert]
        hops += d["hops"]
        steps += d["step_gaps"]
    return dict(speed=float(np.median(r)), **host_terms(hops, steps, hw.inter_link, h.top_k * h.hidden_size * 4))


def profile_at(prof: dict, cond: dict):
    """``prof`` with its fit scaled by the speed factor and the node's wake-up latency set."""
    d = json.loads(json.dumps(prof))
    d["node"]["wake_latency_s"] = cond["wake_latency_s"]
    d["fits"][MODEL].update({k: d["fits"][MODEL][k] * cond["speed"] for k in ("k1", "k1_ctx", "k2", "k3", "k4")})
    return profile_from_dict(d, "cpu_node")


def predict(run: dict, prof: dict, req, prefill: bool, use_conditions: bool = True) -> dict:
    """Simulator and closed form for one measured run, under the machine's conditions then."""
    cond = conditions(prof, run["seq"], prefill) if use_conditions else \
        {"speed": 1.0, "wake_latency_s": prof["node"]["wake_latency_s"], "iteration_overhead_s": 0.0}
    hw, shape = profile_at(prof, cond), load_shape(MODEL)
    times = FittedTimes(hw, shape, hw.fits[MODEL])
    A, E, m = run["replicas"], run["expert_ranks"], run["m"]
    wl = Workload(int(round(req.prompt_len.mean())), int(round(req.output_len.mean())))
    model = DisaggModel(shape, times, times, wl, "float32")
    plan = Plan(1, A, 1, E, m, int(min(len(req), A * MAX_SEQS)))
    cfg = JobConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS,
                    routing=Routing("load", load=tuple(map(tuple, run["route_counts"]))),
                    iteration_overhead_s=cond["iteration_overhead_s"])
    sim = simulate_job(model, plan, req, cfg).summary()
    return {"conditions": cond, "sim": {k: sim[k] for k in METRICS},
            "closed_form": closed_form_job(model, plan, req, cond["iteration_overhead_s"])}


def err(p, m):
    return (p - m) / m


def report(names, prefill: bool) -> dict:
    base = base_profile(prefill)
    rows, kinds = [], ("sim", "closed_form", "sim_pooled_fit")
    for w in names:
        req = requests_for(w)
        for A, E, m in LAYOUTS:
            runs = []
            for p in sorted(glob.glob(os.path.join(RUN_DIR, f"{w}_a{A}e{E}m{m}_r*.json"))):
                with open(p) as f:
                    runs.append(json.load(f))
            if not runs:
                continue
            meas = {k: statistics.median(measured_summary(r)[k] for r in runs) for k in METRICS}
            pred = [predict(r, base, req, prefill) for r in runs]
            pp = [predict(r, base, req, prefill, use_conditions=False)["sim"] for r in runs]
            row = {"workload": w, "layout": f"A{A}:E{E} m{m}", "repeats": len(runs),
                   "conditions": [p["conditions"] for p in pred],
                   "measured": meas, "measured_runs": [measured_summary(r) for r in runs]}
            for kind, ps in (("sim", [p["sim"] for p in pred]), ("closed_form", [p["closed_form"] for p in pred]),
                             ("sim_pooled_fit", pp)):
                row[kind] = {k: statistics.median(p[k] for p in ps) for k in METRICS}
                row[kind + "_err"] = {k: err(row[kind][k], meas[k]) for k in METRICS}
            rows.append(row)
    print(f"\n{'workload':<13}{'layout':<11}{'metric':<13}{'measured':>10}{'sim':>10}{'err':>8}"
          f"{'closed':>10}{'err':>8}{'sim(pooled)':>12}{'err':>8}")
    unit = {"ttft_s_p50": ("TTFT p50 ms", 1e3), "tpot_s_p50": ("TPOT p50 ms", 1e3),
            "throughput_tok_s": ("tok/s", 1.0)}
    for r in rows:
        for k in METRICS:
            lab, f = unit[k]
            print(f"{r['workload']:<13}{r['layout']:<11}{lab:<13}{r['measured'][k] * f:10.1f}" + "".join(
                f"{r[kind][k] * f:{12 if kind == 'sim_pooled_fit' else 10}.1f}{r[kind + '_err'][k]:+8.1%}"
                for kind in kinds))
    summary = {}
    for kind in kinds:
        e = [abs(r[kind + "_err"][k]) for r in rows for k in METRICS]
        if e:
            summary[kind] = {"max_abs_err": max(e), "median_abs_err": statistics.median(e),
                             "target_met": max(e) <= 0.20 and statistics.median(e) <= 0.10}
            print(f"{kind:<15} max |err| {max(e):6.1%}, median {statistics.median(e):6.1%} (target 20% / 10%: "
                  f"{'met' if summary[kind]['target_met'] else 'NOT met'})")
    return {"fit": base["fits"][MODEL], "fit_includes_prefill": prefill, "rows": rows, "summary": summary}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma list of workload names")
    ap.add_argument("--predict-only", action="store_true", help="use the stored runs")
    a = ap.parse_args(argv)
    names = [w for w in WORKLOADS if a.only is None or w in a.only.split(",")]
    if not a.predict_only:
        for p in glob.glob(os.path.join(RUN_DIR, "*.json")):
            os.remove(p)
        measure(names, a.repeats)
    runs = []
    for p in sorted(glob.glob(os.path.join(RUN_DIR, "[!c]*.json"))):
        with open(p) as f:
            runs.append(json.load(f))
    loads = [r["load_average"] for r in runs if r.get("load_average") is not None]
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
           # the runs' own: a --predict-only pass must not stamp today's machine on old measurements
           "measured": [min((r["date"] for r in runs if r.get("date")), default=None),
                        max((r["date"] for r in runs if r.get("date")), default=None)],
           "load_average": [min(loads), max(loads)] if loads else None, "model": MODEL, "layouts": LAYOUTS,
           "scheduler": {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": MAX_TOKENS},
           "note": "2-core VM shared with other jobs; measured metrics are medians over repeats"}
    for prefill in (True, False):  # the jobs prefill chunks of up to 512 tokens: the first is the answer
        print(f"\nlayer fit from the calibration runs' decode {'and prefill ' if prefill else ''}spans"
              + ("" if prefill else " only (the usual in-situ fit; prefill extrapolated)"))
        out["fit_with_prefill" if prefill else "fit_decode_only"] = report(names, prefill)
    write_json(os.path.join(RESULTS, "validate_sim.json"), out)


if __name__ == "__main__":
    main()
