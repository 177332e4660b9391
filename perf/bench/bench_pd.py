"""Prefill-decode disaggregation on this machine (docs/pd.md): TTFT and TPOT p50/p99 with and
without prefill ranks on the same number of ranks, the KV bytes sent, and the share of transfer
time hidden behind prefill compute.

    python perf/bench/bench_pd.py [--ranks 4 --num 8 --long-prompt 256 --long-output 4
                             --short-prompt 16 --short-output 32 --m 2 --prefill-tp 1
                             --repeats 1 --calibrate B,P,D --trace --out perf/results/bench_pd.json]

Two workloads (greedy, eos ignored, random prompts, all requests at once): ``long_prompt``
(``--num`` prompts of ``--long-prompt`` tokens, ``--long-output`` new tokens) and
``short_prompt`` (``--short-prompt`` / ``--short-output``). Model: the ~49M-parameter
Mixtral-shaped bench50m (dummy weights, fp32, one thread per rank). Layouts on ``--ranks``
ranks: the baseline, 1 attention replica + ``ranks-1`` expert ranks (it prefills and decodes),
PD, 1 prefill rank + 1 decode attention replica + ``ranks-2`` expert ranks, and with
``--prefill-tp N`` > 1 also PD with one prefill replica of N TP ranks (experts split over them)
+ 1 decode attention replica + ``ranks-1-N`` expert ranks. Each layout is
one mpiexec launch (``perf/jobs/pd_bench_job.py``) running a warm-up job, then each workload.

Figures: TTFT (arrival at the engine that prefills it -> first token), TPOT (mean time per
output token after the first), prefill end -> decode start (``kv_handoff_s``: the prefill
rank's step end to the decode replica starting the request), KV bytes sent, and the hidden
share: per transfer, 1 - (its last send completing after the prefill step's forward ended) /
(first layer posted -> last send complete), summed over transfers (completion is observed when
the prefill rank polls, so the exposed part is an upper bound). Greedy tokens of all layouts
must agree. Writes ``perf/results/bench_pd.json``.

``--repeats N``: every layout is launched N times, the layouts alternating (baseline, pd, pd,
baseline, ...); each row's figures are the medians over its launches (``runs``: each launch's
own figures). The machine is shared: the 1-min load average is sampled every 5 s while the
launches run (each row: ``load_average`` = the mean over its launches' samples) and its mean over
the whole run is recorded in ``perf/results/pd_load_average.json`` under the output's file name.
``--calibrate B,P,D``: a traced bench50m probe run (``perf/validate/calibrate_bench50m.py``: batch B,
prompt P, D new tokens) before each launch and after the last, kept in ``calibrations`` (each
launch's ``calibration``: the index of the probe before it); ``perf/validate/validate_sim_pd.py`` reads
the machine's speed at each launch off them. ``--trace``: the measured jobs are traced, their
ranks' spans kept beside the result (OUT's stem + ``.spans.json.gz``). Every launch records each
rank's CPU seconds (``cpu_s``: [role, seconds]).
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))

from mpi_launch import run_job  # noqa: E402
from perf_paths import RESULTS  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402

from bench_conditions import LoadSampler, calibration  # noqa: E402
from megainfer.bench.pd_runs import spans_path  # noqa: E402


def pct(xs, q):
    xs = [x for x in xs if x is not None]
    return None if not xs else float(np.percentile(xs, q))


def summarise(r: dict) -> dict:
    pre = r["prefill"]
    window = sum(p["transfer_s"] for p in pre)
    exposed = sum(p["exposed_s"] for p in pre)
    return dict(seconds=r["seconds"], cpu_s=r.get("cpu_s"),
                ttft_p50_ms=1e3 * pct(r["ttft_s"], 50), ttft_p99_ms=1e3 * pct(r["ttft_s"], 99),
                tpot_p50_ms=1e3 * pct(r["tpot_s"], 50), tpot_p99_ms=1e3 * pct(r["tpot_s"], 99),
                handoff_p50_ms=None if not r["handoff_s"] else 1e3 * pct(r["handoff_s"], 50),
                handoff_p99_ms=None if not r["handoff_s"] else 1e3 * pct(r["handoff_s"], 99),
                kv_bytes_sent=sum(p["kv_bytes_sent"] for p in pre) if pre else 0,
                transfers=sum(p["transfers"] for p in pre) if pre else 0,
                hidden_fraction=None if window <= 0 else 1 - exposed / window)


def median_row(runs: list[dict]) -> dict:
    """Each figure's median over the launches (None where a launch has none)."""
    out = {}
    for k in (k for k in runs[0] if k not in ("calibration", "spans", "cpu_s")):
        xs = [r[k] for r in runs if r[k] is not None]
        out[k] = statistics.median(xs) if xs else None
    return out


def record_load(out: str, samples: list, note: str) -> None:
    path = os.path.join(RESULTS, "pd_load_average.json")
    d = json.load(open(path)) if os.path.isfile(path) else {}
    d[os.path.basename(out)] = round(statistics.mean(samples), 2)
    d[f"_note_{os.path.basename(out)}"] = note
    write_json(path, d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--num", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=256)
    ap.add_argument("--long-output", type=int, default=4)
    ap.add_argument("--short-prompt", type=int, default=16)
    ap.add_argument("--short-output", type=int, default=32)
    ap.add_argument("--m", type=int, default=2)
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--trace", action="store_true",
                    help="trace the measured jobs: their ranks' spans go to OUT's stem + .spans.json.gz")
    ap.add_argument("--calibrate", default=None, metavar="B,P,D",
                    help="before each launch and after the last, one traced bench50m calibration "
                         "run (perf/validate/calibrate_bench50m.py) of batch B, prompt P, D new tokens")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_pd.json"))
    a = ap.parse_args()
    workloads = [dict(name="long_prompt", num=a.num, prompt_len=a.long_prompt,
                      output_len=a.long_output),
                 dict(name="short_prompt", num=a.num, prompt_len=a.short_prompt,
                      output_len=a.short_output)]
    base = dict(m=a.m, max_num_seqs=16, max_num_batched_tokens=512, block_size=16,
                num_blocks=512, workloads=workloads, trace=a.trace)
    layouts = {"baseline": dict(A=1, E=a.ranks - 1, P=0), "pd": dict(A=1, E=a.ranks - 2, P=1)}
    if a.prefill_tp > 1:  # a prefill replica of that many TP ranks, fewer expert ranks
        layouts[f"pd_tp{a.prefill_tp}"] = dict(A=1, E=a.ranks - 1 - a.prefill_tp, P=1,
                                               PTP=a.prefill_tp)
    raw, loads, rows = {n: [] for n in layouts}, {n: [] for n in layouts}, []
    t0 = datetime.datetime.now(datetime.timezone.utc)
    cals, seqs = [], {n: [] for n in layouts}
    for rep in range(a.repeats):
        for name in (list(layouts) if rep % 2 == 0 else list(layouts)[::-1]):
            if a.calibrate:
                cals.append(calibration(a.calibrate))
            with LoadSampler() as ls:
                raw[name].append(run_job(a.ranks, "pd_bench_job.py", f"/tmp/bench_pd_{name}.json",
                                         [json.dumps(dict(base, **layouts[name]))]))
            loads[name] += ls.samples
            seqs[name].append(len(cals) - 1)
            print(f"  {name} launch {rep + 1}/{a.repeats}: load average "
                  f"{statistics.mean(ls.samples):.2f}", flush=True)
    spans = {}
    for w in workloads:
        same = all(raw["baseline"][0][w["name"]]["tokens"] == r[w["name"]]["tokens"]
                   for n in layouts for r in raw[n])
        for name in layouts:
            runs = [dict(summarise(r[w["name"]]), calibration=k) for r, k in zip(raw[name], seqs[name])]
            if a.trace:  # beside the result, unindented: a launch has ~10^4 spans
                spans[f"{w['name']}/{name}"] = [r[w["name"]]["spans"] for r in raw[name]]
            rows.append(dict(workload=w["name"], layout=name, tokens_match=same,
                             load_average=statistics.mean(loads[name]), **median_row(runs),
                             runs=runs))
    hdr = ("workload", "layout", "job s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
           "handoff p50/p99 ms", "KV MiB", "hidden")
    print(" | ".join(hdr))

    def f(v, d=1):
        return "-" if v is None else f"{v:.{d}f}"
    for r in rows:
        print(" | ".join([r["workload"], r["layout"], f(r["seconds"], 2),
                          f"{f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])}",
                          f"{f(r['tpot_p50_ms'])} / {f(r['tpot_p99_ms'])}",
                          f"{f(r['handoff_p50_ms'])} / {f(r['handoff_p99_ms'])}",
                          f(r["kv_bytes_sent"] / 2**20, 2),
                          "-" if r["hidden_fraction"] is None else f"{100 * r['hidden_fraction']:.1f}%"]))
    if not all(r["tokens_match"] for r in rows):
        print("WARNING: greedy tokens differ between layouts")
    if a.calibrate:
        cals.append(calibration(a.calibrate))
    if a.trace:
        with gzip.open(spans_path(a.out), "wt") as f:
            json.dump(spans, f)
    samples = [x for v in loads.values() for x in v]
    write_json(a.out, dict(calibrations=cals,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(), cpus=os.cpu_count(), args=vars(a), layouts=layouts,
        load_average=statistics.mean(samples), rows=rows))
    record_load(a.out, samples, f"1-min load average sampled every 5 s during `perf/bench/bench_pd.py "
                f"{' '.join(sys.argv[1:])}` "
                f"({t0:%Y-%m-%d %H:%M}-{datetime.datetime.now(datetime.timezone.utc):%H:%M} UTC), "
                f"mean of {len(samples)} samples, range {min(samples):.2f}-{max(samples):.2f}")


if __name__ == "__main__":
    main()
