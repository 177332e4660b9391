"""The served live planner (``replan.policy=planner``, docs/replan.md "The live planner") against
every fixed plan it could choose, on one replayed trace whose phases ask for different plans:

    python perf/bench/bench_planner_trace.py [--ranks 3 --plans a1e2m1,a1e2m2,a2e1m1,a2e1m2
        --start a1e2m2 --shape prompt_heavy_burst:40,decode_heavy_steady:40 --rate 2
        --input-len 64 --output-len 32 --slo-ttft-ms 2000 --slo-tpot-ms 250 --repeats 3]

Each run is one ``mpiexec -n ranks megainfer-serve`` (bench50m shapes, dummy weights, fp32, one
thread per rank), a 4-request warm-up, then the trace (``megainfer-bench-serve --trace-shape``'s
generator, same seed every run) replayed open loop by this process's client, greedy with eos
ignored. The fixed plans are ``deploy=a1e2`` with ``deploy.attention_replicas`` /
``expert_ranks`` / ``micro_batches`` set; the planner run starts from ``--start`` with
``replan.enabled=true replan.policy=planner`` and the ``--planner-*`` settings. Runs alternate
order between repeats (fixed plans then the planner, then the reverse). Goodput is vLLM's: the
requests that finished within both SLOs, per second of the run (and per phase, from the
phase's first send to its last answer). Per run it records the switches (seconds into the
trace, from the ``replans_total`` counter), ``megainfer:replan_switch_seconds`` and the
planner's decisions with what they predicted (``GET /planner``; a decision's ``at_s`` is put on
the trace's clock by the time between the server listening and the trace starting, so to about
one planner interval). Summary: the planner's median goodput against the best fixed plan's
(goal >= 1.15x), the fixed plans' spread beside it, the best fixed plan per phase (the planner
can only win where that differs). Writes ``perf/results/bench_planner_trace.json``, each run
as it finishes.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import replace

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perf_paths import RESULTS  # noqa: E402
from serve_process import ServerProcess  # noqa: E402

from megainfer.bench import serve_load, serve_trace  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402
from megainfer.bench.serve_requests import trace_requests  # noqa: E402
from megainfer.core_client.mpiexec_job import find_mpiexec  # noqa: E402

PLAN = re.compile(r"^a(\d+)e(\d+)m(\d+)$")
VOCAB = 8192


def plan_overrides(label: str) -> list[str]:
    """``aNeMmK`` -> the deploy overrides of that fixed split."""
    m = PLAN.match(label)
    if m is None:
        raise SystemExit(f"--plans/--start: {label!r} is not aNeMmK (e.g. a1e2m2)")
    a, e, k = m.groups()
    return ["deploy=a1e2", f"deploy.attention_replicas={a}", f"deploy.expert_ranks={e}",
            f"deploy.micro_batches={k}"]


def bench_args(port: int, a) -> argparse.Namespace:
    return serve_load.parse_args([
        "--base-url", f"http://127.0.0.1:{port}", "--model", "bench50m",
        "--trace-shape", a.shape, "--request-rate", str(a.rate),
        "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--random-vocab-size", str(VOCAB), "--ignore-eos", "--disable-tqdm",
        "--seed", str(a.seed), "--goodput", f"ttft:{a.slo_ttft_ms}", f"tpot:{a.slo_tpot_ms}",
        "--metric-percentiles", f"{a.slo_percentile:g}", "--percentile-metrics", "ttft,tpot"])


def switch_seconds(port: int) -> dict:
    """``megainfer:replan_switch_seconds`` so far: {kind: [count, sum]}."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    out: dict = {}
    for part, i in (("count", 0), ("sum", 1)):
        for kind, v in re.findall(r'^megainfer:replan_switch_seconds_' + part +
                                  r'\{kind="(\w+)"[^}]*\} (\S+)$', text, re.M):
            out.setdefault(kind, [0.0, 0.0])[i] = float(v)
    return out


def run_one(label: str, a) -> dict:
    """One server, warm-up, the trace; its figures."""
    planner = label == "planner"
    start = a.start if planner else label
    common = ["model=bench50m", "serve.served_model_name=bench50m",
              f"scheduler.max_num_seqs={a.max_num_seqs}", "deploy.cpu_threads=1",
              f"slo.ttft_ms={a.slo_ttft_ms}", f"slo.tpot_ms={a.slo_tpot_ms}",
              f"slo.percentile={a.slo_percentile}"]
    extra = ["replan.enabled=true", "replan.policy=planner",
             f"replan.planner_interval_s={a.planner_interval_s}",
             f"replan.horizon_s={a.planner_horizon_s}", f"replan.dwell_s={a.planner_dwell_s}",
             f"replan.confirm={a.planner_confirm}", f"replan.min_gain={a.planner_min_gain}",
             "replan.micro_batches=plan"] if planner else []
    server = ServerProcess(a.ranks, [*plan_overrides(start), *common, *extra], a.mpiexec)
    listening = time.perf_counter()
    out: dict = {"plan": label, "start": start}
    try:
        ba = bench_args(server.port, a)
        warm = trace_requests(serve_trace.trace_rows(ba), VOCAB, a.seed + 1)[:4]
        asyncio.run(serve_load.run(serve_load.parse_args([
            "--base-url", f"http://127.0.0.1:{server.port}", "--model", "bench50m",
            "--disable-tqdm", "--ignore-eos"]), [replace(r, at=None) for r in warm]))
        reqs = trace_requests(serve_trace.trace_rows(ba), VOCAB, a.seed)
        switches: list = []
        offset = time.perf_counter() - listening
        results, dur = asyncio.run(serve_load.run(ba, reqs, switches))
        d = serve_load.summarize(ba, results, dur)
        out.update({k: v for k, v in d.items() if not isinstance(v, (list, dict))
                    or k == "goodput_slos_ms"})
        out["phases"] = serve_load.summarize_phases(ba, results)
        out["switches_at_s"], out["switch_seconds"] = switches, switch_seconds(server.port)
        if planner:
            view = httpx.get(f"http://127.0.0.1:{server.port}/planner").json()
            for e in view["decisions"]:
                e["trace_s"] = e["at_s"] - offset
            out["planner"] = view
    finally:
        out["exit_code"] = server.stop()
    return out


def summary(runs: list[dict], a) -> dict:
    by: dict[str, list] = {}
    for r in runs:
        by.setdefault(r["plan"], []).append(r)
    med = {p: statistics.median(r["request_goodput"] for r in rs) for p, rs in by.items()}
    spread = {p: [min(r["request_goodput"] for r in rs), max(r["request_goodput"] for r in rs)]
              for p, rs in by.items()}
    phases = list(runs[0]["phases"])
    phase_med = {p: {ph: statistics.median(r["phases"][ph]["request_goodput"] for r in rs)
                     for ph in phases} for p, rs in by.items()}
    fixed = [p for p in med if p != "planner"]
    best = max(fixed, key=med.get)
    best_by_phase = {ph: max(fixed, key=lambda p: phase_med[p][ph]) for ph in phases}
    return dict(median_goodput=med, spread=spread, phase_goodput=phase_med, best_fixed=best,
                best_fixed_by_phase=best_by_phase,
                planner_vs_best=med["planner"] / med[best] if med[best] else None,
                best_differs_between_phases=len(set(best_by_phase.values())) > 1,
                failed=sum(r["failed"] for r in runs),
                switch_s_max=max((s[1] / s[0] for r in runs for s in r["switch_seconds"].values()
                                  if s[0]), default=None))


def table(s: dict) -> str:
    phases = list(next(iter(s["phase_goodput"].values())))
    head = f"{'plan':<10}{'goodput':>9}{'min':>7}{'max':>7}" + "".join(f"{p[:20]:>22}"
                                                                      for p in phases)
    rows = [head, "-" * len(head)]
    for p, g in s["median_goodput"].items():
        lo, hi = s["spread"][p]
        rows.append(f"{p:<10}{g:>9.3f}{lo:>7.3f}{hi:>7.3f}" +
                    "".join(f"{s['phase_goodput'][p][ph]:>22.3f}" for ph in phases))
    ratio = s["planner_vs_best"]
    rows.append(f"goodput in req/s within the SLOs (median of repeats; per phase likewise). "
                f"best fixed: {s['best_fixed']}; by phase: {s['best_fixed_by_phase']}; planner "
                f"/ best fixed = {'-' if ratio is None else f'{ratio:.2f}'} (goal >= 1.15); "
                f"failed requests {s['failed']}; longest switch {s['switch_s_max']}")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--plans", default="a1e2m1,a1e2m2,a2e1m1,a2e1m2")
    ap.add_argument("--start", default="a1e2m2", help="the planner run's launch plan")
    ap.add_argument("--shape", default="prompt_heavy_burst:40,decode_heavy_steady:40")
    ap.add_argument("--rate", type=float, default=2.0, help="the phases' base rate, req/s")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000)
    ap.add_argument("--slo-tpot-ms", type=float, default=250)
    ap.add_argument("--slo-percentile", type=float, default=90)
    ap.add_argument("--planner-interval-s", type=float, default=5.0)
    ap.add_argument("--planner-horizon-s", type=float, default=30.0)
    ap.add_argument("--planner-dwell-s", type=float, default=20.0)
    ap.add_argument("--planner-confirm", type=int, default=2)
    ap.add_argument("--planner-min-gain", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mpiexec", default=find_mpiexec())
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_planner_trace.json"))
    a = ap.parse_args(argv)
    labels = a.plans.split(",") + ["planner"]
    for p in labels[:-1] + [a.start]:
        plan_overrides(p)
    doc = dict(bench="bench_planner_trace", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
               load_before=os.getloadavg(), args=vars(a), runs=[])
    for k in range(a.repeats):
        for label in (labels if k % 2 == 0 else labels[::-1]):
            r = run_one(label, a)
            r["repeat"] = k
            print(f"[{k}] {label}: goodput {r['request_goodput']:.3f} req/s, "
                  f"{r['completed']}/{r['num_prompts']} done, switches {r['switches_at_s']}",
                  flush=True)
            doc["runs"].append(r)
            write_json(a.out, doc, quiet=True)  # as each run finishes
    doc["load_after"] = os.getloadavg()
    doc["summary"] = summary(doc["runs"], a)
    write_json(a.out, doc)
    print(table(doc["summary"]))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
