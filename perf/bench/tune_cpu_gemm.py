"""Measure the CPU GEMM methods of ``megainfer.kernels.cpu_gemm`` per row count and thread
count, and write the rule table the library reads (``kernels/cpu_gemm_rules.json``).

    python perf/bench/tune_cpu_gemm.py [--threads 1 2 --repeats 11 --no-write]

Shapes: the bench50m-family weights a decode step reads, per kind and dtype (``--dtypes``:
fp32 writes ``expert`` / ``dense``, bf16 ``expert.bfloat16`` / ``dense.bfloat16``): ``expert`` (gate_up
[2N, H] and down [H, N] of 8 experts, timed together as one layer's expert pass, so the cache
holds what a real step holds) and ``dense`` (q/k/v/o projections and lm_head). Rows: 1 to 512
(decode to prefill chunks). For each (kind, threads, rows) the fastest of ``--repeats``
samples of every method (mm, skinny, onednn): the minimum, not the median, since on a shared
machine other processes only ever add time; each sample after a read of ``--flush-mb`` MB
(1024: over this box's 480 MB L3), so the weights come from memory as in a decode step
(warm, oneDNN's packed weights looked faster at one row than the step found them). At 1 thread the clock is this thread's CPU time
(what the op costs, whoever else runs); at more threads the wall clock (CPU time would hide a
thread that waits descheduled), so those rules are only as good as the quietest sample. The
rule keeps, among the methods within ``--margin`` of the fastest, the first in the order
onednn, mm, skinny; a cell at more threads whose fastest sample is 1.5x slower than at fewer
threads was disturbed and keeps the fewer-thread choice; a thread count > 1 timed while the
load average left it fewer free cores than threads gets no rule at all (``cores_were_free``:
``cpu_gemm.method_for`` then uses the fewer-thread rule). Prints a table and writes
``perf/results/tune_cpu_gemm.json`` (the samples, the machine, the load average).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

from megainfer.kernels import cpu_gemm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
from megainfer.bench.results_io import write_json  # noqa: E402
from perf_paths import RESULTS  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
PREFERENCE = ("onednn", "mm", "skinny")
DISTURBED = 1.5


def weights(kind: str, hidden: int, inter: int, experts: int, vocab: int,
            dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "expert":
        shapes = [(2 * inter, hidden), (hidden, inter)] * experts
    else:
        shapes = [(hidden, hidden), (hidden // 2, hidden), (hidden // 2, hidden), (hidden, hidden),
                  (vocab, hidden)]
    return [(torch.randn(*s, generator=g) * 0.02).to(dtype) for s in shapes]


def time_method(ws, rows: int, method: str, kind: str, repeats: int, flush=None) -> float:
    """The fastest of ``repeats`` passes over ``ws`` at ``rows`` rows with ``method``; each
    after a read of ``flush`` (when given) that evicts the weights from the caches, as a decode
    step meets them (each read once per step)."""
    xs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in ws]
    rules = {k: {"1": [[None, method]]} for k in cpu_gemm.KINDS + cpu_gemm.BF16_KINDS}

    def run():
        for x, w in zip(xs, ws):
            cpu_gemm.linear(x, w, kind=kind)

    threads = torch.get_num_threads()
    clock = time.thread_time if threads == 1 else time.perf_counter
    with cpu_gemm.use_rules(rules):
        run()
        samples = []
        for _ in range(repeats):
            if flush is not None:
                flush.sum()
            t0 = clock()
            run()
            samples.append(clock() - t0)
    return min(samples)


def choices(times: dict, margin: float, fewer: dict = None) -> dict:
    """{rows: {method: s}} -> {rows: method}. ``fewer``: the same at the next lower thread
    count ({rows: (method, fastest s)}); a cell whose fastest sample is over ``DISTURBED`` x
    slower than there was disturbed by other load (more threads are not that much slower on
    an idle machine) and keeps the lower count's choice."""
    out = {}
    for rows, t in times.items():
        fastest = min(t.values())
        if fewer is not None and fastest > DISTURBED * fewer[rows][1]:
            out[rows] = (fewer[rows][0], fewer[rows][1])
            continue
        out[rows] = (next(m for m in PREFERENCE if t[m] <= fastest * (1 + margin)), fastest)
    return out


def cores_were_free(threads: int, load_at_start: float) -> bool:
    """Wall-clock samples at ``threads`` threads mean something only when other processes left
    that many cores: the 1-minute load average, before and after the cell, at most
    cpu_count - threads + 0.5 (the 2-thread rules of 2026-12-01, timed at load 15, chose MKL and
    the weight-major form where oneDNN was faster on a quieter machine)."""
    free = (os.cpu_count() or 1) - threads + 0.5
    return load_at_start <= free and os.getloadavg()[0] <= free


def rule_from(chosen: dict) -> list:
    """{rows: (method, s)} -> [[max_rows, method], ..., [None, method]] (runs merged)."""
    best = [(rows, chosen[rows][0]) for rows in sorted(chosen)]
    steps = []
    for i, (rows, m) in enumerate(best):
        last = i == len(best) - 1
        if last or best[i + 1][1] != m:
            steps.append([None if last else rows, m])
    return steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"],
                    help="activation/weight dtypes: float32 writes expert/dense, bfloat16 "
                         "expert.bfloat16/dense.bfloat16")
    ap.add_argument("--flush-mb", type=int, default=1024,
                    help="MB read before each sample, evicting the weights from the caches "
                         "(0: warm samples)")
    ap.add_argument("--no-write", dest="write", action="store_false")
    ap.add_argument("--out", default=os.path.join(RESULTS, "tune_cpu_gemm.json"))
    a = ap.parse_args(argv)
    flush = torch.ones(a.flush_mb * 2 ** 18) if a.flush_mb else None  # fp32: a.flush_mb MB
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    keys = [(k, d) for d in a.dtypes for k in cpu_gemm.KINDS]
    samples, skipped = {}, []
    rules = {(k if d == "float32" else f"{k}.{d}"): {} for k, d in keys}
    load0 = os.getloadavg()
    for kind, dname in keys:
        key = kind if dname == "float32" else f"{kind}.{dname}"
        ws = weights(kind, a.hidden, a.inter, a.experts, a.vocab, dtypes[dname])
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        fewer = None
        for t in sorted(a.threads):
            torch.set_num_threads(t)
            load_at_start = os.getloadavg()[0]
            times = {}
            for rows in ROWS:
                times[rows] = {m: time_method(ws, rows, m, kind, a.repeats, flush)
                               for m in cpu_gemm.METHODS}
                r = times[rows]
                print(f"{key:<16}{t:>3} thr {rows:>5} rows  " + "  ".join(
                    f"{m} {r[m] * 1e3:7.2f} ms ({nbytes / r[m] / 1e9:5.1f} GB/s)"
                    for m in cpu_gemm.METHODS), flush=True)
            fewer = choices(times, a.margin, fewer)
            samples[f"{key},{t}"] = {str(r): v for r, v in times.items()}
            if t == 1 or cores_were_free(t, load_at_start):
                rules[key][str(t)] = rule_from(fewer)
            else:  # no rule from wall clocks of shared cores: t threads use the fewer-thread one
                skipped.append(dict(kind=key, threads=t, load_average=os.getloadavg()[0]))
                print(f"{key} {t} threads: not written, the load average "
                      f"{os.getloadavg()[0]:.1f} left fewer than {t} of {os.cpu_count()} "
                      "cores free", flush=True)
    write_tuned("tune_cpu_gemm", a, load0, samples, rules, skipped, cpu_gemm.RULES_PATH)


def write_tuned(name: str, a, load0, samples: dict, rules: dict, skipped: list,
                rules_path) -> None:
    """A tuner's end (this one's and ``tune_cpu_qgemm.py``'s): every sample with the machine
    and its load to ``a.out``; with ``a.write`` the rules to ``rules_path``, the table the
    kernels read."""
    load = [load0, os.getloadavg()]
    print("rules:", json.dumps(rules))
    print(f"load average at start / end: {load[0][0]:.1f} / {load[1][0]:.1f}")
    machine = dict(platform=platform.platform(), processor=platform.processor(),
                   cpu_count=os.cpu_count(), torch=torch.__version__, load_average=load)
    write_json(a.out, dict(name=name, date=datetime.datetime.now().isoformat(timespec="seconds"),
                           machine=machine, args=vars(a), seconds=samples, rules=rules,
                           not_written=skipped), indent=2)
    if a.write:
        table = dict(source=f"perf/bench/{name}.py", date=datetime.date.today().isoformat(),
                     machine=machine, rules=rules)
        with open(rules_path, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")

if __name__ == "__main__":
    main()
