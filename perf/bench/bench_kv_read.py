"""The CPU decode step with the paged KV read in place against the same step gathering it
(``models/kv_gather.py``), and the step over scattered block tables (which must gather).

    python perf/bench/bench_kv_read.py [--batches 8 32 64 --threads 1 --context 100 --repeats 15]
        (JSON: perf/results/bench_kv_read.json)

Model and step: bench_decode_step's (the 54.5M Mixtral-shaped checkpoint, B rows of
``--context`` cached tokens, ``perf/bench/decode_steps.py``), fp32.

* in place:  the shipped code over the bench's tables (row r's blocks one run, rows adjacent:
  ``kv_gather.affine_layout`` holds, SDPA reads strided views of the cache).
* gathered:  the same step and tables with ``kv_gather.context_in_place`` patched to decline,
  i.e. the gather into scratch of the code before (the baseline).
* scattered: the shipped code over the same blocks shuffled across rows (no row one run, as an
  engine's tables after blocks were freed and reused): the gather path.

Rounds alternate the three; medians over ``--repeats`` rounds after 3 warm-up rounds; the
load average beside every row. Then (``--no-jobs`` skips it) how often the engine's own tables
allow the in-place read: bench_decode_step's two jobs (equal lengths 32 x 64/64, mixed 64
requests) through ``LLM.generate``, counting decode rows and prefill reads in place or gathered.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
import bench_offline  # noqa: E402
from bench_decode_step import SHAPE  # noqa: E402
from decode_steps import OursStep, ScatteredStep, time_once  # noqa: E402
from perf_paths import RESULTS  # noqa: E402

from megainfer.bench.results_io import write_json  # noqa: E402


def bench(a, model) -> list[dict]:
    from megainfer.models import kv_gather
    shipped, rows = kv_gather.context_in_place, []
    for t in a.threads:
        torch.set_num_threads(t)
        for B in a.batches:
            steps = dict(in_place=OursStep(model, B, a.context), gathered=OursStep(model, B, a.context),
                         scattered=ScatteredStep(model, B, a.context))
            s = {k: [] for k in steps}
            try:
                for _ in range(a.repeats + 3):
                    for name, step in steps.items():
                        kv_gather.context_in_place = (
                            (lambda *args, **kw: None) if name == "gathered" else shipped)
                        s[name].append(time_once(step))
            finally:
                kv_gather.context_in_place = shipped
            med = {k: statistics.median(v[3:]) for k, v in s.items()}  # 3 warm-up rounds
            rows.append(dict(threads=t, batch=B, context=a.context, median_s=med, samples_s=s,
                             gathered_over_in_place=med["gathered"] / med["in_place"],
                             load_average=os.getloadavg()))
            print(f"{t:>3} {B:>4} {med['in_place'] * 1e3:9.2f} {med['gathered'] * 1e3:9.2f} "
                  f"{med['scattered'] * 1e3:9.2f} {med['gathered'] / med['in_place']:8.3f}x "
                  f"{rows[-1]['load_average'][0]:5.1f}", flush=True)
    return rows


def engine_tables(path: str) -> dict:
    """{job: {in_place, gathered, prefill_in_place, prefill_gathered}}: decode rows (counted once
    per step, from the step's plan) and prefill context reads (per layer) of bench_decode_step's
    jobs through the engine."""
    import collections

    from bench_decode_step import mixed_workload
    from megainfer import LLM
    from megainfer.models import attention, decode_attention, kv_gather
    counts, plan, read = collections.Counter(), decode_attention.decode_plan, kv_gather.read_context

    def counting_plan(meta, dtype, *args):
        fresh = ("decode", dtype) not in meta.step_cache
        p = plan(meta, dtype, *args)
        for g in p.groups if fresh else ():
            counts["in_place" if g.layout else "gathered"] += g.stop - g.start
        return p

    def counting_read(kv, blocks, length, dtype=None, layout=None):
        if blocks.dim() == 1:  # a prefill chunk's one sequence
            counts["prefill_in_place" if layout else "prefill_gathered"] += 1
        return read(kv, blocks, length, dtype, layout)

    g = torch.Generator().manual_seed(0)
    jobs = dict(equal=(torch.randint(3, SHAPE["vocab"], (32, 64), generator=g).tolist(), [64] * 32),
                mixed=mixed_workload(64, SHAPE["vocab"]))
    out = {}
    decode_attention.decode_plan, attention.read_context = counting_plan, counting_read
    try:
        for name, (prompts, outs) in jobs.items():
            llm = LLM(path, max_num_seqs=64, max_num_batched_tokens=2048, block_size=16,
                      max_model_len=max(map(len, prompts)) + max(outs), enable_prefix_caching=False)
            counts.clear()
            bench_offline.run_ours(llm, prompts, outs)
            out[name] = dict(counts)
            print(f"{name:<6} decode rows in place {counts['in_place']:>5} gathered "
                  f"{counts['gathered']:>5}; prefill reads in place {counts['prefill_in_place']:>4} "
                  f"gathered {counts['prefill_gathered']:>4}", flush=True)
    finally:
        decode_attention.decode_plan, attention.read_context = plan, read
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-jobs", dest="jobs", action="store_false")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_kv_read.json"))
    a = ap.parse_args(argv)
    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.models.loader import build_model
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        bench_offline.build_checkpoint(d, SimpleNamespace(**SHAPE))
        model = build_model(ModelConfig.from_pretrained(d), LoadConfig(path=d))
        print(f"decode step, context {a.context}, load average {load0[0]:.1f}\n{'thr':>3} {'B':>4} "
              f"{'in place':>9} {'gathered':>9} {'scattered':>9} {'gain':>9} {'load':>5}")
        rows = bench(a, model)
        tables = engine_tables(d) if a.jobs else None
    load = os.getloadavg()
    write_json(a.out, dict(
        name="bench_kv_read", args=vars(a), shape=SHAPE, rows=rows, engine_tables=tables,
        baseline="gathered: the same step and tables, in-place reads declined, alternating rounds",
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), cpu_count=os.cpu_count(),
                     python=sys.version.split()[0], torch=torch.__version__,
                     load_average=[load0, load])), indent=2)
    print(f"load average at start / end: {load0[0]:.1f} / {load[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
