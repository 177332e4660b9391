"""Prefill-decode disaggregation on this machine (docs/pd.md): TTFT and TPOT p50/p99 with and
without prefill ranks on the same number of ranks, the KV bytes sent, and the share of transfer
time hidden behind prefill compute.

    python perf/bench_pd.py [--ranks 4 --num 8 --long-prompt 256 --long-output 4
                             --short-prompt 16 --short-output 32 --m 2 --prefill-tp 1]

Two workloads (greedy, eos ignored, random prompts, all requests at once): ``long_prompt``
(``--num`` prompts of ``--long-prompt`` tokens, ``--long-output`` new tokens) and
``short_prompt`` (``--short-prompt`` / ``--short-output``). Model: the ~49M-parameter
Mixtral-shaped bench50m (dummy weights, fp32, one thread per rank). Layouts on ``--ranks``
ranks: the baseline, 1 attention replica + ``ranks-1`` expert ranks (it prefills and decodes),
PD, 1 prefill rank + 1 decode attention replica + ``ranks-2`` expert ranks, and with
``--prefill-tp N`` > 1 also PD with one prefill replica of N TP ranks (experts split over them)
+ 1 decode attention replica + ``ranks-1-N`` expert ranks. Each layout is
one mpiexec launch (``perf/pd_bench_job.py``) running a warm-up job, then each workload.

Figures: TTFT (arrival at the engine that prefills it -> first token), TPOT (mean time per
output token after the first), prefill end -> decode start (``kv_handoff_s``: the prefill
rank's step end to the decode replica starting the request), KV bytes sent, and the hidden
share: per transfer, 1 - (its last send completing after the prefill step's forward ended) /
(first layer posted -> last send complete), summed over transfers (completion is observed when
the prefill rank polls, so the exposed part is an upper bound). Greedy tokens of all layouts
must agree. Writes ``perf/results/bench_pd.json``.
"""
from __future__ import annotations

import argparse
import json
import datetime
import os
import platform
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from mpi_launch import run_job  # noqa: E402
from results_io import write_json  # noqa: E402


def pct(xs, q):
    xs = [x for x in xs if x is not None]
    return None if not xs else float(np.percentile(xs, q))


def summarise(r: dict) -> dict:
    pre = r["prefill"]
    window = sum(p["transfer_s"] for p in pre)
    exposed = sum(p["exposed_s"] for p in pre)
    return dict(seconds=r["seconds"],
                ttft_p50_ms=1e3 * pct(r["ttft_s"], 50), ttft_p99_ms=1e3 * pct(r["ttft_s"], 99),
                tpot_p50_ms=1e3 * pct(r["tpot_s"], 50), tpot_p99_ms=1e3 * pct(r["tpot_s"], 99),
                handoff_p50_ms=None if not r["handoff_s"] else 1e3 * pct(r["handoff_s"], 50),
                handoff_p99_ms=None if not r["handoff_s"] else 1e3 * pct(r["handoff_s"], 99),
                kv_bytes_sent=sum(p["kv_bytes_sent"] for p in pre) if pre else 0,
                transfers=sum(p["transfers"] for p in pre) if pre else 0,
                hidden_fraction=None if window <= 0 else 1 - exposed / window)


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
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_pd.json"))
    a = ap.parse_args()
    workloads = [dict(name="long_prompt", num=a.num, prompt_len=a.long_prompt,
                      output_len=a.long_output),
                 dict(name="short_prompt", num=a.num, prompt_len=a.short_prompt,
                      output_len=a.short_output)]
    base = dict(m=a.m, max_num_seqs=16, max_num_batched_tokens=512, block_size=16,
                num_blocks=512, workloads=workloads)
    layouts = {"baseline": dict(A=1, E=a.ranks - 1, P=0), "pd": dict(A=1, E=a.ranks - 2, P=1)}
    if a.prefill_tp > 1:  # a prefill replica of that many TP ranks, fewer expert ranks
        layouts[f"pd_tp{a.prefill_tp}"] = dict(A=1, E=a.ranks - 1 - a.prefill_tp, P=1,
                                               PTP=a.prefill_tp)
    raw, rows = {}, []
    for name, lay in layouts.items():
        raw[name] = run_job(a.ranks, "pd_bench_job.py", f"/tmp/bench_pd_{name}.json",
                            [json.dumps(dict(base, **lay))])
    for w in workloads:
        same = all(raw["baseline"][w["name"]]["tokens"] == raw[n][w["name"]]["tokens"]
                   for n in layouts)
        for name in layouts:
            s = summarise(raw[name][w["name"]])
            rows.append(dict(workload=w["name"], layout=name, tokens_match=same, **s))
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
    write_json(a.out, dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(), cpus=os.cpu_count(), args=vars(a), layouts=layouts, rows=rows))


if __name__ == "__main__":
    main()
