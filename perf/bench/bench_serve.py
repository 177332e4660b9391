"""megainfer-serve in several deploy modes against the offline engine and the planner's simulator
on the same requests (bench50m shapes, dummy weights), in one run:

    python perf/bench/bench_serve.py [--device cpu|cuda] [--modes single,auto,pd]
        [--num-prompts 32 --input-len 32 --output-len 16 --rates 1,4,inf --out PATH]

Modes: ``single`` (a plain megainfer-serve: the frontend, its engine core a child process),
``single_thread`` (one process, the core on a thread beside the frontend:
``serve.engine_process=false``), ``auto`` (``mpiexec -n 3 ... deploy=auto``: the planner's
split of 3 ranks), ``a1e2`` (``mpiexec -n 3``), ``pd`` (``mpiexec -n 4 ... deploy=p1a1e2``),
``planned`` (``mpiexec -n 4 ... deploy=auto slo.arrival_rate=..``: the split the planner picks
for serving the first finite rate within the SLOs, AE or PD) and ``a2e2`` (4 ranks, no prefill
ranks: the AE plan beside it).
For each mode a server (``python -m megainfer.launch.serve``, under mpiexec for all but single;
the same scheduler and cache settings) is started and, 3 s after it listens, its idle CPU per
rank over 3 s is recorded; megainfer-bench-serve's client (this process) then runs each
``--rates`` value (Poisson; ``inf``: all at once), reporting TTFT / TPOT p50 and p99 and goodput
for ``--slo-ttft-ms`` / ``--slo-tpot-ms``, beside what the planner's job simulator predicts for
the same plan, rate and SLOs (``serve_prediction.py``; none for single mode). Single mode also
measures its two goals, ``--reps`` times each with the two sides back to back (the offline
engine in this process while the server sleeps, then the server), and takes the medians:
1. the offline job: ``LLM.generate`` on every request at once (greedy, eos ignored): output
   tokens/s, against the server's with every request at once (goal >= 0.90x);
2. the engine's own prefill time (``LLM.generate`` of one prompt, max_tokens=1, median of 5),
   against the server's median TTFT one request at a time (goal <= 1.2 x prefill + 5 ms).
Writes ``perf/results/bench_serve[_cuda].json``.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perf_paths import RESULTS  # noqa: E402

from serve_prediction import predict  # noqa: E402
from serve_process import ServerProcess  # noqa: E402

from megainfer.bench.process_cpu import idle_cpu  # noqa: E402
from megainfer.core_client.mpiexec_job import find_mpiexec  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402
from megainfer.bench.shapes import BENCH50M, BENCH50M_SHAPE  # noqa: E402

MODES = {"single": (1, "single"), "single_thread": (1, "single"), "auto": (3, "auto"),
         "a1e2": (3, "a1e2"), "pd": (4, "p1a1e2"), "planned": (4, "auto"),
         "a2e2": (4, "auto")}  # name -> (ranks, deploy preset)
IDLE_SETTLE_S = 3.0  # seconds between a server listening and its idle CPU window
EXTRA = {"single_thread": ["serve.engine_process=false"],  # name -> its own server overrides
         "a2e2": ["deploy.attention_replicas=2", "deploy.expert_ranks=2",
                  "deploy.prefill_replicas=0", "deploy.micro_batches=1"]}


def mode_overrides(name: str, a) -> list:
    """``name``'s own overrides; ``planned``: deploy=auto planning a server for the first
    finite ``--rates`` value, the lengths and the SLOs of this run (docs/perfmodel.md,
    "Planning a server")."""
    if name != "planned":
        return EXTRA.get(name, [])
    rate = next(r for r in a.rates.split(",") if r != "inf")
    return [f"slo.arrival_rate={rate}", f"slo.ttft_ms={a.slo_ttft_ms}",
            f"slo.tpot_ms={a.slo_tpot_ms}", f"slo.percentile={a.slo_percentile}",
            f"slo.input_len={a.input_len}", f"slo.output_len={a.output_len}",
            f"slo.num_requests={a.num_prompts}"]


def bench_args(port, n, rate, conc, a):
    from megainfer.bench import serve_load as bench
    return bench.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--model", "bench50m",
                             "--num-prompts", str(n), "--request-rate", str(rate),
                             "--random-input-len", str(a.input_len), "--random-output-len",
                             str(a.output_len), "--random-vocab-size", "8192", "--ignore-eos",
                             "--metric-percentiles", "50,99", "--disable-tqdm",
                             "--goodput", f"ttft:{a.slo_ttft_ms}", f"tpot:{a.slo_tpot_ms}",
                             "--percentile-metrics", "ttft,tpot,itl,e2el"]
                            + (["--max-concurrency", str(conc)] if conc else []))


def engine_iterations(port: int) -> tuple[float, float]:
    """(seconds, count) of the server's ``iteration_time_seconds`` so far, every role."""
    import httpx
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    total = [0.0, 0.0]
    for i, part in enumerate(("sum", "count")):
        for v in re.findall(rf"^megainfer:iteration_time_seconds_{part}\{{[^}}]*\}} (\S+)$", text,
                            re.M):
            total[i] += float(v)
    return total[0], total[1]


def run_bench(server: ServerProcess, reqs, rate, conc, a) -> dict:
    """One benchmark run; with the server's (every rank's) and this client's CPU seconds, and
    the engine core's own iteration time in it (``engine_busy_s``: how much of the run the core
    spent iterating, as it times itself)."""
    from megainfer.bench import serve_load as bench
    ba = bench_args(server.port, len(reqs), rate, conc, a)
    c_srv, c_cli = server.cpu_s(), time.process_time()
    busy0, iters0 = engine_iterations(server.port)
    res, dur = asyncio.run(bench.run(ba, reqs))
    d = bench.summarize(ba, res, dur)
    d["server_cpu_s"] = sum(server.cpu_s()) - sum(c_srv)
    d["client_cpu_s"] = time.process_time() - c_cli
    busy1, iters1 = engine_iterations(server.port)
    d["engine_busy_s"], d["engine_iterations"] = busy1 - busy0, iters1 - iters0
    print(bench.table(ba, d), f"\nserver CPU {d['server_cpu_s']:.2f} s, client CPU "
          f"{d['client_cpu_s']:.2f} s, engine core iterating {d['engine_busy_s']:.2f} s of "
          f"{dur:.2f} s ({d['engine_iterations']:.0f} iterations)", flush=True)
    return {k: v for k, v in d.items() if k not in ("input_lens", "output_lens", "ttfts",
                                                    "itls", "errors")}


class OfflineEngine:
    """The offline job in this process (the same scheduler settings and torch threads as the
    server): ``generate`` times ``LLM.generate`` on every request at once (output tokens/s, CPU
    seconds); ``prefill_s`` the engine's own prefill of one prompt (max_tokens=1, median of 5)."""

    def __init__(self, reqs, a):
        from megainfer import LLM, SamplingParams
        self.reqs = reqs
        self.llm = LLM(BENCH50M, device=a.device, max_num_seqs=a.max_num_seqs,
                       cpu_threads=a.threads)
        self.params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
        self.one = SamplingParams(temperature=0, max_tokens=1)
        self.llm.generate([r.prompt for r in reqs[:4]], self.params, use_tqdm=False)  # warm-up

    def generate(self) -> dict:
        t, c, steps = time.perf_counter(), time.process_time(), self.llm.engine.num_steps
        outs = self.llm.generate([r.prompt for r in self.reqs], self.params, use_tqdm=False)
        s, cpu = time.perf_counter() - t, time.process_time() - c
        tok = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"seconds": s, "cpu_s": cpu, "output_tokens": tok, "output_throughput": tok / s,
                "iterations": self.llm.engine.num_steps - steps}

    def prefill_s(self) -> float:
        pre = []
        for r in self.reqs[:5]:
            t = time.perf_counter()
            self.llm.generate(r.prompt, self.one, use_tqdm=False)
            pre.append(time.perf_counter() - t)
        return statistics.median(pre)


def single_goals(server: "ServerProcess", reqs, a) -> dict:
    """The two single-mode goals, each ratio taken ``--reps`` times with its two sides run back
    to back (a shared host's load moves within seconds), and their medians: saturated
    throughput (all requests at once) against the offline job's, and the median TTFT one
    request at a time against the engine's prefill + 5 ms."""
    off = OfflineEngine(reqs, a)
    reps = []
    for _ in range(a.reps):
        o, sat = off.generate(), run_bench(server, reqs, "inf", None, a)
        pre, low = off.prefill_s(), run_bench(server, reqs[:8], "inf", 1, a)
        reps.append({"offline": o, "saturated": sat, "engine_prefill_s": pre,
                     "one_at_a_time": low,
                     "saturated_vs_offline": sat["output_throughput"] / o["output_throughput"],
                     "saturated_server_cpu_vs_offline_cpu": sat["server_cpu_s"] / o["cpu_s"],
                     # the served core's mean iteration against the offline engine's (the same
                     # requests; what the frontend's work next to it costs the engine itself)
                     "served_iteration_ms": 1e3 * sat["engine_busy_s"] / sat["engine_iterations"],
                     "offline_iteration_ms": 1e3 * o["seconds"] / o["iterations"],
                     "saturated_engine_busy_fraction": sat["engine_busy_s"] / sat["duration"],
                     "ttft_vs_prefill_plus_5ms": low["median_ttft_ms"] / 1000 / (pre + 0.005)})
    med = {k: statistics.median(r[k] for r in reps) for k in (
        "saturated_vs_offline", "saturated_server_cpu_vs_offline_cpu",
        "ttft_vs_prefill_plus_5ms", "served_iteration_ms", "offline_iteration_ms",
        "saturated_engine_busy_fraction")}
    for k, f in (("offline_tok_s", lambda r: r["offline"]["output_throughput"]),
                 ("saturated_tok_s", lambda r: r["saturated"]["output_throughput"]),
                 ("engine_prefill_ms", lambda r: 1e3 * r["engine_prefill_s"]),
                 ("one_at_a_time_ttft_ms", lambda r: r["one_at_a_time"]["median_ttft_ms"])):
        med[k] = statistics.median(f(r) for r in reps)
    return {"reps": reps, "median": med}


def resolved_deploy(deploy: str, ranks: int, overrides: list[str]):
    """The plan rank 0 resolves (``deploy=auto``: the planner's split of ``ranks``)."""
    from hydra import compose, initialize_config_module

    from megainfer.engine.job_doors import serve_tree
    from megainfer.engine.job_doors import settings_from_config
    with initialize_config_module("megainfer.conf", version_base=None):
        c, _ = serve_tree(compose("serve", [f"deploy={deploy}", *overrides]))
    return settings_from_config(c, ranks, ranks, 0, holds_cache=False).deploy


def run_mode(name: str, reqs, a) -> dict:
    from megainfer.perfmodel.plan.goodput import Slo
    ranks, deploy = MODES[name]
    common = ["model=bench50m", f"scheduler.max_num_seqs={a.max_num_seqs}",
              f"deploy.device={a.device}", f"deploy.cpu_threads={a.threads}"]
    plan = resolved_deploy(deploy, ranks, common + mode_overrides(name, a))
    server = ServerProcess(ranks, [f"deploy={deploy}", "serve.served_model_name=bench50m",
                                   *common, *mode_overrides(name, a)], a.mpiexec)
    out = {"ranks": ranks, "deploy": deploy, "plan": {
        k: getattr(plan, k) for k in ("mode", "attention_replicas", "attention_tp",
                                      "expert_ranks", "micro_batches", "prefill_replicas")}}
    try:
        time.sleep(IDLE_SETTLE_S)  # the start-up's tail (a first idle window reads 3-5x higher)
        out["idle_cpu_per_rank"] = idle_cpu(server.pids, 3.0)
        run_bench(server, reqs[:4], "inf", None, a)  # warm-up
        if ranks == 1:
            out["goals"] = single_goals(server, reqs, a)
        out["rates"] = {r: run_bench(server, reqs, r, None, a) for r in a.rates.split(",")}
    finally:
        out["exit_code"] = server.stop()
    slo = Slo(a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3, a.slo_percentile)
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    out["predicted"] = {r: predict(BENCH50M_SHAPE, plan, float(r), len(reqs), a.input_len,
                                   a.output_len, slo, a.max_num_seqs, 512, dtype, a.device)
                        for r in a.rates.split(",")}
    return out


def comparison(modes: dict, a) -> str:
    rows = [f"{'mode':<8} {'rate':>5} | {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
            f"{'goodput':>8} | {'sim TTFT p50':>12} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
            f"{'goodput':>8}"]
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    g = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for name, m in modes.items():
        for r, d in m["rates"].items():
            p = m["predicted"].get(r) or {}
            rows.append(f"{name:<8} {r:>5} | {f(d['median_ttft_ms']):>9} "
                        f"{f(d['p99_ttft_ms']):>8} {f(d['median_tpot_ms']):>9} "
                        f"{f(d['p99_tpot_ms']):>7} {g(d['request_goodput']):>8} | "
                        f"{f(p.get('p50_ttft_ms')):>12} {f(p.get('p99_ttft_ms')):>8} "
                        f"{f(p.get('p50_tpot_ms')):>9} {f(p.get('p99_tpot_ms')):>7} "
                        f"{g(p.get('request_goodput')):>8}")
    return (f"TTFT/TPOT in ms, goodput in req/s within TTFT {a.slo_ttft_ms:g} ms and TPOT "
            f"{a.slo_tpot_ms:g} ms; sim: the planner's job simulator, same plan and workload\n"
            + "\n".join(rows))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--modes", default="single,auto,pd", help=f"of {','.join(MODES)}")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128, help="vLLM's default; with a few "
                   "tokens a request, the saturated run is mostly the burst's arrival")
    p.add_argument("--rates", default="1,4,inf")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=1000)
    p.add_argument("--slo-tpot-ms", type=float, default=200)
    p.add_argument("--slo-percentile", type=float, default=90)
    p.add_argument("--reps", type=int, default=7, help="back-to-back pairs per single-mode "
                   "goal (their median is the figure)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server rank "
                   "and of the offline engine (1: two OpenMP threads on a busy 2-core host ran "
                   "the 50M model ~10x slower)")
    p.add_argument("--mpiexec", default=find_mpiexec(),
                   help="the MPI launcher of the distributed modes (default: $MPIEXEC, else "
                        "the venv's)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    for m in a.modes.split(","):
        if m not in MODES:
            raise SystemExit(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    import torch
    from megainfer.bench.serve_requests import random_requests
    torch.set_num_threads(a.threads)
    reqs = random_requests(a.num_prompts, a.input_len, a.output_len, 0.0, 8192, 0)
    load_before = os.getloadavg()
    modes, failed = {}, {}
    for m in a.modes.split(","):
        try:
            modes[m] = run_mode(m, reqs, a)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the other modes still run
            print(f"[bench_serve] mode {m} failed: {type(e).__name__}: {e}", flush=True)
            failed[m] = f"{type(e).__name__}: {e}"
    res = {
        "conditions": {"device": a.device, "host": platform.node(), "cpu_threads": a.threads,
                       "cores": os.cpu_count(), "load_average_before": load_before,
                       "load_average": os.getloadavg(), "model": "bench50m (dummy weights)",
                       "num_prompts": a.num_prompts, "input_len": a.input_len,
                       "output_len": a.output_len, "max_num_seqs": a.max_num_seqs,
                       "slo_ms": {"ttft": a.slo_ttft_ms, "tpot": a.slo_tpot_ms,
                                  "percentile": a.slo_percentile},
                       "note": "servers in subprocesses (single: a plain megainfer-serve, its "
                               "engine core a child process; single_thread: the core on a thread "
                               "of the server's process; mpiexec for the distributed modes), "
                               "client (httpx) in this process"},
        "modes": modes,
        "failed_modes": failed,
    }
    print("\n" + comparison(modes, a))
    for sname in [m for m in modes if MODES[m][0] == 1]:
        single = modes[sname]
        med = single["goals"]["median"]
        if sname == "single":
            res.update({k: med[k] for k in ("saturated_vs_offline", "ttft_vs_prefill_plus_5ms",
                                            "saturated_server_cpu_vs_offline_cpu")})
        pairs = single["goals"]["reps"]
        print(f"\n{sname}, medians of {a.reps} back-to-back pairs: offline "
              f"{med['offline_tok_s']:.1f} tok/s, served saturated {med['saturated_tok_s']:.1f} "
              f"tok/s (ratio {med['saturated_vs_offline']:.3f}, goal >= 0.90; each pair: "
              + ", ".join(f"{r['saturated_vs_offline']:.2f}" for r in pairs)
              + f"); TTFT one at a time {med['one_at_a_time_ttft_ms']:.1f} ms vs prefill "
              f"{med['engine_prefill_ms']:.1f} ms + 5 ms (ratio "
              f"{med['ttft_vs_prefill_plus_5ms']:.3f}, goal <= 1.2; each pair: "
              + ", ".join(f"{r['ttft_vs_prefill_plus_5ms']:.2f}" for r in pairs)
              + "); saturated server CPU / offline CPU "
              f"{med['saturated_server_cpu_vs_offline_cpu']:.3f}; the engine core iterating "
              f"{100 * med['saturated_engine_busy_fraction']:.0f}% of the saturated run, "
              f"{med['served_iteration_ms']:.1f} ms an iteration vs the offline engine's "
              f"{med['offline_iteration_ms']:.1f} ms")
    for name, m in modes.items():
        print(f"{name}: idle CPU per rank (% of a core) "
              + ", ".join(f"{100 * c:.2f}" for c in m["idle_cpu_per_rank"])
              + f"; exit code after SIGTERM {m['exit_code']}")
    print(f"load average before {load_before}, after {os.getloadavg()}")
    out = a.out or os.path.join(RESULTS, "bench_serve" +
                                ("_cuda" if a.device == "cuda" else "") + ".json")
    write_json(out, res)


if __name__ == "__main__":
    main()
