"""Measure the two CPU expert paths of ``megainfer.kernels.torch_moe`` per (model dtype, rows,
threads), print them side by side with the per-expert path as the baseline, and write the rule
table the library reads (``kernels/cpu_moe_rules.json``; ``cpu_moe_rules.py`` owns its form).

    python perf/bench/tune_cpu_moe.py [--threads 1 2 --repeats 21 --rows 1 8 32 --no-write]

Paths: ``per_expert`` (``grouped_moe`` / ``one_row_moe``: a GEMM pair per expert with slots,
oneDNN over packed weights, as shipped before this table) and ``grouped_mm``
(``grouped_mm_moe``: two ``torch._grouped_mm`` calls per layer), each through
``fused_moe_torch`` under a table forcing it. Shapes: the 54.5M Mixtral checkpoint of
``bench_decode_step.py`` (hidden 512, inter 1024) and bench50m (``conf/model/bench50m.yaml``:
hidden 512, inter 768), both 8 experts top-2; a sample is one pass over ``--layers`` layers of
distinct weights (a decode step's expert work), tokens routed by a seeded random softmax top-k,
the same for both paths, after a read of ``--flush-mb`` MB that evicts the weights from the
caches (the 2-core box's L3 is 480 MB: unflushed, the 4 layers' experts stay in it from one
sample to the next, and a path reading the same dense weights as the one timed just before
it ran warm, 1.75x at B = 1 where the decode step saw 1.02-1.07x; in a step the other layers'
weights, the packs, the KV cache and other tenants share the L3). The paths alternate within
each repeat (which goes first alternates too); the figure is the median of ``--repeats``
samples, CPU time at 1 thread (what the op costs, whoever else runs), the wall clock above.
The rule takes ``grouped_mm`` for a (dtype, threads, rows) only where its median is over
``--margin`` faster than the per-expert one at every shape; a thread count > 1 timed while the
load average left fewer free cores than threads gets no rule (``tune_cpu_gemm.cores_were_free``:
the fewer-thread rule applies). A third column, ``per_expert_mkl`` (the per-expert path with the
expert GEMM rule forced to MKL, ``cpu_gemm`` method ``mm``), is timed in the same rounds but
is no candidate: it tells how much of a grouped_mm gain is its GEMM (``_grouped_mm`` on CPU
loops ``at::mm`` over the groups, unpacked weights) rather than its grouping. Writes
``perf/results/tune_cpu_moe.json`` (medians, minima, the paths' largest difference, the
machine and its load average).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from megainfer.kernels import cpu_gemm, cpu_moe_rules
from megainfer.kernels.torch_moe import fused_moe_torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from tune_cpu_gemm import cores_were_free, rule_from, write_tuned  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # decode batches to prefill chunks
SHAPES = {"mixtral54m": dict(hidden=512, inter=1024, experts=8, top_k=2),
          "bench50m": dict(hidden=512, inter=768, experts=8, top_k=2)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
METHODS = ("per_expert", "grouped_mm", "per_expert_mkl")  # the rule's two, then a diagnostic
MKL = {kind: {"1": [[None, "mm"]]} for kind in cpu_gemm.KINDS}


def layers(shape: dict, dtype: torch.dtype, n: int, seed: int = 0) -> list[tuple]:
    """``n`` layers' (w1 [E, 2I, H], w2 [E, H, I]) in ``dtype``, HF's gate_up / down layout."""
    g = torch.Generator().manual_seed(seed)
    E, H, inter = shape["experts"], shape["hidden"], shape["inter"]
    return [((torch.randn(E, 2 * inter, H, generator=g) * 0.02).to(dtype),
             (torch.randn(E, H, inter, generator=g) * 0.02).to(dtype)) for _ in range(n)]


def routing(rows: int, shape: dict, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed + rows)
    x = torch.randn(rows, shape["hidden"], generator=g).to(dtype)  # [B, H]
    logits = torch.randn(rows, shape["experts"], generator=g)  # [B, E]
    w, ids = torch.topk(torch.softmax(logits, -1), shape["top_k"], dim=-1)  # [B, k]
    return x, w.to(dtype), ids


def time_cell(ws, x, w, ids, repeats: int, flush: torch.Tensor) -> dict:
    """{method: [s, ...]} for one pass over every layer, the methods alternating, each sample
    after a read of ``flush``; plus the largest |difference| of their outputs."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    tables = {m: cpu_moe_rules.forced(m.removesuffix("_mkl")) for m in METHODS}

    def run(m):
        with (cpu_moe_rules.use_rules(tables[m]),
              cpu_gemm.use_rules(MKL if m == "per_expert_mkl" else None)):
            return [fused_moe_torch(x, w1, w2, w, ids) for w1, w2 in ws]

    outs = {m: run(m) for m in METHODS}  # warm-up: oneDNN packs, scratch
    diff = max((a.float() - b.float()).abs().max().item()
               for m in METHODS[1:] for a, b in zip(outs["per_expert"], outs[m]))
    samples = {m: [] for m in METHODS}
    for r in range(repeats):
        for m in (METHODS if r % 2 == 0 else METHODS[::-1]):  # which goes first alternates
            flush.sum()  # evict the weights: each sample starts from memory
            t0 = clock()
            run(m)
            samples[m].append(clock() - t0)
    return dict(samples=samples, max_abs_diff=diff)


def choose(cells: dict, margin: float) -> dict:
    """{shape: {rows: cell}} of one (dtype, threads) -> {rows: (method, per_expert median)}:
    grouped_mm where it is over ``margin`` faster at every shape."""
    rows = sorted(next(iter(cells.values())))
    out = {}
    for r in rows:
        faster = all(c[r]["grouped_mm"]["median_s"] < (1 - margin) * c[r]["per_expert"]["median_s"]
                     for c in cells.values())
        out[r] = ("grouped_mm" if faster else "per_expert",
                  min(c[r]["per_expert"]["median_s"] for c in cells.values()))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--flush-mb", type=int, default=1024,
                    help="MB read before each sample (above the L3 size: cold weights)")
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--no-write", dest="write", action="store_false")
    ap.add_argument("--out", default=os.path.join(RESULTS, "tune_cpu_moe.json"))
    a = ap.parse_args(argv)
    load0 = os.getloadavg()
    samples, rules, skipped = {}, {d: {} for d in a.dtypes}, []
    flush = torch.ones(a.flush_mb * 2 ** 18)  # fp32: a.flush_mb MB
    print(f"{'shape':<11}{'dtype':<9}{'thr':>3} {'rows':>5}  {'per_expert ms':>13}  "
          f"{'grouped_mm ms':>13}  {'speedup':>7}  {'per_exp MKL ms':>14}  {'max|diff|':>9}",
          flush=True)
    for dname in a.dtypes:
        dtype = DTYPES[dname]
        for t in sorted(a.threads):
            torch.set_num_threads(t)
            load_at_start = os.getloadavg()[0]
            cells = {}
            for sname, shape in SHAPES.items():
                ws = layers(shape, dtype, a.layers)
                cells[sname] = {}
                for rows in a.rows:
                    c = time_cell(ws, *routing(rows, shape, dtype), a.repeats, flush)
                    cell = {m: dict(median_s=statistics.median(s), min_s=min(s))
                            for m, s in c["samples"].items()}
                    cell.update(max_abs_diff=c["max_abs_diff"], load_average=os.getloadavg()[0],
                                speedup=cell["per_expert"]["median_s"] /
                                cell["grouped_mm"]["median_s"])
                    cells[sname][rows] = cell
                    print(f"{sname:<11}{dname:<9}{t:>3} {rows:>5}  "
                          f"{cell['per_expert']['median_s'] * 1e3:>13.2f}  "
                          f"{cell['grouped_mm']['median_s'] * 1e3:>13.2f}  "
                          f"{cell['speedup']:>6.2f}x  "
                          f"{cell['per_expert_mkl']['median_s'] * 1e3:>14.2f}  "
                          f"{c['max_abs_diff']:>9.1e}", flush=True)
                samples[f"{sname},{dname},{t}"] = {str(r): v for r, v in cells[sname].items()}
            if t == 1 or cores_were_free(t, load_at_start):
                rules[dname][str(t)] = rule_from(choose(cells, a.margin))
            else:  # no rule from wall clocks of shared cores: t threads use the fewer-thread one
                skipped.append(dict(dtype=dname, threads=t, load_average=os.getloadavg()[0]))
                print(f"{dname} {t} threads: no rule, the load average {os.getloadavg()[0]:.1f} "
                      f"left fewer than {t} of {os.cpu_count()} cores free", flush=True)
    rules = {d: t for d, t in rules.items() if t}  # a dtype with no rule takes DEFAULT
    write_tuned("tune_cpu_moe", a, load0, samples, rules, skipped, cpu_moe_rules.RULES_PATH)


if __name__ == "__main__":
    main()
