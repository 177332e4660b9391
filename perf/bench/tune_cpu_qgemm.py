"""Measure the CPU ops of ``megainfer.kernels.cpu_qgemm`` for int8/int4 weights per
(format, activation dtype, rows, threads) and write the rule table the library reads
(``kernels/cpu_qgemm_rules.json``; ``cpu_qgemm_rules.py`` owns its form and lookup).

    python perf/bench/tune_cpu_qgemm.py [--threads 1 2 --repeats 9 --no-write]

Shapes: the bench50m-family weights of one decode layer (hidden 512, inter 1024: attention
q/k/v/o and 2 experts' gate_up [2N, H] and down [H, N], the experts a row hits), timed together
per method as one pass, activations drawn in the dtype. Methods: ``cpu_qgemm_rules.METHODS``
(``weight_only``: torch's weight-only kernel; ``dequant``: dequantised for the call, then
F.linear). As ``tune_cpu_gemm.py``: the minimum of ``--repeats`` samples, CPU time at 1 thread
and the wall clock above; a method within ``--margin`` of the fastest keeps the preference
order ``dequant`` (row-count independent cost), ``weight_only``; a thread count timed while the
load average left it fewer free cores gets no rule (the fewer-thread one applies). Writes
``perf/results/tune_cpu_qgemm.json`` (samples, machine, load average).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from megainfer.kernels import cpu_qgemm, cpu_qgemm_rules
from megainfer.kernels.weight_quant import QuantizedWeight, WeightFormat, quantize

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from tune_cpu_gemm import cores_were_free, rule_from, write_tuned  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
PREFERENCE = ("dequant", "weight_only")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def layer_weights(fmt_name: str, dtype: torch.dtype, hidden: int, inter: int,
                  group: int) -> list[QuantizedWeight]:
    """One decode layer's quantised weights [N, K]: q, k, v, o and 2 experts' gate_up, down."""
    g = torch.Generator().manual_seed(0)
    shapes = [(hidden, hidden), (hidden // 2, hidden), (hidden // 2, hidden), (hidden, hidden)]
    shapes += [(2 * inter, hidden), (hidden, inter)] * 2
    fmt = WeightFormat(fmt_name, group_size=group)
    out = []
    for s in shapes:
        data, scale = quantize(torch.randn(*s, generator=g) * 0.02, fmt, dtype)
        out.append(QuantizedWeight(data, scale, fmt, s))
    return out


def time_method(qws, dtype, rows: int, method: str, repeats: int) -> float:
    xs = [torch.randn(rows, w.shape[1]).to(dtype) for w in qws]
    key = cpu_qgemm_rules.rule_key(qws[0].fmt.name, dtype)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    with cpu_qgemm_rules.use_rules({key: {"1": [[None, method]]}}):
        def run():
            for x, w in zip(xs, qws):
                cpu_qgemm.qlinear(x, w)
        run()
        samples = []
        for _ in range(repeats):
            t0 = clock()
            run()
            samples.append(clock() - t0)
    return min(samples)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--no-write", dest="write", action="store_false")
    ap.add_argument("--out", default=os.path.join(RESULTS, "tune_cpu_qgemm.json"))
    a = ap.parse_args(argv)
    samples, rules, skipped = {}, {}, []
    load0 = os.getloadavg()
    for key in cpu_qgemm_rules.KEYS:
        fmt_name, dname = key.split("/")
        qws = layer_weights(fmt_name, DTYPES[dname], a.hidden, a.inter, a.group)
        for t in sorted(a.threads):
            torch.set_num_threads(t)
            load_at_start = os.getloadavg()[0]
            times, chosen = {}, {}
            for rows in ROWS:
                r = times[rows] = {m: time_method(qws, DTYPES[dname], rows, m, a.repeats)
                                   for m in cpu_qgemm_rules.METHODS}
                fastest = min(r.values())
                chosen[rows] = (next(m for m in PREFERENCE if r[m] <= fastest * (1 + a.margin)),
                                fastest)
                print(f"{key:<14}{t:>2} thr {rows:>4} rows  " + "  ".join(
                    f"{m} {r[m] * 1e3:8.3f} ms" for m in cpu_qgemm_rules.METHODS)
                    + f"  -> {chosen[rows][0]}", flush=True)
            samples[f"{key},{t}"] = {str(r): v for r, v in times.items()}
            if t == 1 or cores_were_free(t, load_at_start):
                rules.setdefault(key, {})[str(t)] = rule_from(chosen)
            else:
                skipped.append(dict(key=key, threads=t, load_average=os.getloadavg()[0]))
                print(f"{key} {t} threads: not written (load average "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
    write_tuned("tune_cpu_qgemm", a, load0, samples, rules, skipped,
                cpu_qgemm_rules.RULES_PATH)

if __name__ == "__main__":
    main()
