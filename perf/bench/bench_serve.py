"""megainfer-serve vs the offline engine on the same requests (single mode, bench50m shapes,
dummy weights), in one run:

    python perf/bench/bench_serve.py [--device cpu|cuda] [--num-prompts 64 --input-len 64
                                --output-len 32 --rates 2,8,inf --out PATH]

1. the offline job: ``LLM.generate`` on every request at once (greedy, eos ignored): output
   tokens/s;
2. the engine's own prefill time: ``LLM.generate`` of one prompt with max_tokens=1 (median of 5);
3. a ``megainfer-serve`` subprocess (``python -m megainfer.launch.serve model=bench50m``, the same
   scheduler and cache settings) driven by megainfer-bench-serve's client from this process:
   one request at a time (TTFT against 1.2 x prefill + 5 ms), then each ``--rates`` value
   (Poisson; ``inf``: all at once, the saturated throughput against the offline job's, goal
   >= 90%).
The server process is idle (asleep) while the offline part runs; its CPU over 3 s idle is
recorded first. Writes
``perf/results/bench_serve[_cuda].json``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402

from megainfer.bench.results_io import write_json  # noqa: E402
from megainfer.bench.shapes import BENCH50M  # noqa: E402


def bench_args(port, n, rate, conc, a):
    from megainfer.serve import bench
    return bench.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--model", "bench50m",
                             "--num-prompts", str(n), "--request-rate", str(rate),
                             "--random-input-len", str(a.input_len), "--random-output-len",
                             str(a.output_len), "--random-vocab-size", "8192", "--ignore-eos",
                             "--metric-percentiles", "50,99", "--disable-tqdm",
                             "--goodput", f"ttft:{a.slo_ttft_ms}", f"tpot:{a.slo_tpot_ms}",
                             "--percentile-metrics", "ttft,tpot,itl,e2el"]
                            + (["--max-concurrency", str(conc)] if conc else []))


def run_bench(server, port, reqs, rate, conc, a) -> dict:
    """One benchmark run; with the server's and this client's CPU seconds during it."""
    from megainfer.serve import bench
    ba = bench_args(port, len(reqs), rate, conc, a)
    c_srv, c_cli = cpu_seconds(server.pid), time.process_time()
    res, dur = asyncio.run(bench.run(ba, reqs))
    d = bench.summarize(ba, res, dur)
    d["server_cpu_s"] = cpu_seconds(server.pid) - c_srv
    d["client_cpu_s"] = time.process_time() - c_cli
    print(bench.table(ba, d), f"\nserver CPU {d['server_cpu_s']:.2f} s, client CPU "
          f"{d['client_cpu_s']:.2f} s", flush=True)
    return {k: v for k, v in d.items() if k not in ("input_lens", "output_lens", "ttfts",
                                                    "itls", "errors")}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rates", default="2,8,inf")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=1000)
    p.add_argument("--slo-tpot-ms", type=float, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server and "
                   "of the offline engine (1: two OpenMP threads on a busy 2-core host ran the "
                   "50M model ~10x slower)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import torch
    from megainfer import LLM, SamplingParams
    from megainfer.serve.bench_client import random_requests
    threads = a.threads
    torch.set_num_threads(threads)
    reqs = random_requests(a.num_prompts, a.input_len, a.output_len, 0.0, 8192, 0)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "megainfer.launch.serve", "model=bench50m", f"serve.port={port}",
         "serve.served_model_name=bench50m", f"scheduler.max_num_seqs={a.max_num_seqs}",
         f"deploy.device={a.device}", f"deploy.cpu_threads={threads}",
         "hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none",
         "hydra/hydra_logging=none"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""  # the server loaded and listening (then asleep) before the offline part
        while "[serve]" not in line:
            line = server.stdout.readline()
            if not line and server.poll() is not None:
                raise SystemExit("server exited before serving")
        c0, t0 = cpu_seconds(server.pid), time.perf_counter()
        time.sleep(3.0)
        idle_cpu = (cpu_seconds(server.pid) - c0) / (time.perf_counter() - t0)
        llm = LLM(BENCH50M, device=a.device, max_num_seqs=a.max_num_seqs)
        params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
        llm.generate([r.prompt for r in reqs[:4]], params, use_tqdm=False)  # warm-up
        t, c = time.perf_counter(), time.process_time()
        outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
        off_s, off_cpu = time.perf_counter() - t, time.process_time() - c
        off_tok = sum(len(o.outputs[0].token_ids) for o in outs)
        one = SamplingParams(temperature=0, max_tokens=1)
        pre = []
        for r in reqs[:5]:
            t = time.perf_counter()
            llm.generate(r.prompt, one, use_tqdm=False)
            pre.append(time.perf_counter() - t)
        prefill_s = statistics.median(pre)
        del llm
        run_bench(server, port, reqs[:4], "inf", None, a)  # warm-up
        low = run_bench(server, port, reqs[:8], "inf", 1, a)
        rates = {}
        for r in a.rates.split(","):
            rates[r] = run_bench(server, port, reqs, r, None, a)
    finally:
        server.terminate()
        server.wait(60)
    sat = rates.get("inf")
    res = {
        "conditions": {"device": a.device, "host": platform.node(), "cpu_threads": threads,
                       "cores": os.cpu_count(),
                       "load_average": os.getloadavg(), "model": "bench50m (dummy weights)",
                       "num_prompts": a.num_prompts, "input_len": a.input_len,
                       "output_len": a.output_len, "max_num_seqs": a.max_num_seqs,
                       "note": "server in a subprocess, client (httpx) in this process"},
        "offline": {"seconds": off_s, "cpu_s": off_cpu, "output_tokens": off_tok,
                    "output_throughput": off_tok / off_s},
        "engine_prefill_s": prefill_s,
        "idle_server_cpu_fraction_of_a_core": idle_cpu,
        "one_at_a_time": low,
        "rates": rates,
        "saturated_vs_offline": None if sat is None else
        sat["output_throughput"] / (off_tok / off_s),
        "saturated_server_cpu_vs_offline_cpu": None if sat is None else
        sat["server_cpu_s"] / off_cpu,
        "ttft_vs_prefill_plus_5ms": low["median_ttft_ms"] / 1000 / (prefill_s + 0.005),
    }
    print(f"\noffline {off_tok / off_s:.1f} tok/s; served saturated "
          f"{sat['output_throughput'] if sat else float('nan'):.1f} tok/s "
          f"(ratio {res['saturated_vs_offline'] or float('nan'):.3f}, goal >= 0.90); "
          f"TTFT one at a time {low['median_ttft_ms']:.1f} ms vs prefill "
          f"{prefill_s * 1000:.1f} ms + 5 ms (ratio {res['ttft_vs_prefill_plus_5ms']:.3f}, "
          f"goal <= 1.2); saturated server CPU / offline CPU "
          f"{res['saturated_server_cpu_vs_offline_cpu'] or float('nan'):.3f}; idle server {100 * idle_cpu:.2f}% of a core")
    out = a.out or os.path.join(RESULTS, "bench_serve" +
                                ("_cuda" if a.device == "cuda" else "") + ".json")
    write_json(out, res)


if __name__ == "__main__":
    main()
