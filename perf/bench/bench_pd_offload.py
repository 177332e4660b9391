"""Decode attention offloaded to the prefill rank (``pd.offload``, docs/pd.md) against plain PD
on the same 4 ranks (1 prefill + 1 decode attention + 2 expert ranks), on a workload where the
decode rank's KV pool is the limit.

    python perf/bench/bench_pd_offload.py [--num 12 --prompt 96 --output 16 --block-size 16
        --num-blocks 35 --offload-blocks 21 --m 2 --repeats 3 --calibrate B,P,D
        --out perf/results/bench_pd_offload.json]

Model: bench50m (dummy weights, fp32, one thread per rank). Every engine has ``--num-blocks``
blocks (the decode pool: ``num_blocks x block_size`` tokens, here room for 5 whole sequences);
with offload the prefill rank splits its pool: ``--offload-blocks`` for offloaded requests (room
for 3), the rest for prompts in flight. All requests arrive at once, greedy, eos ignored.
Figures per layout (medians over ``--repeats`` launches, the layouts alternating):
the decode engine's largest batch (sequences in one step), its preemptions, tokens/s (output
tokens / job seconds), and with offload the requests offloaded, the per-layer round trip
(mean, ms: the decode rank posting q/k/v to the reply arriving) and the share of it hidden
behind the decode rank's own attention (1 - waited after the local attention / round trip).
Greedy tokens of both layouts must agree. On 2 shared cores four ranks oversubscribe the CPU:
tokens/s is noise-bound; the largest batch and the preemptions are the mechanism's figures.

The prediction beside each row (``simulator``): ``perf/validate/predict_pd_offload.py``'s, the
PD simulator with the offload, calibrated as the PD bench's comparison is (bench50m's in-situ
fits, each launch under the conditions of the probes beside it). ``--calibrate B,P,D``: a traced
bench50m probe (``bench_conditions.calibration``) before each launch and after the last, kept in
``calibrations`` (each launch's ``calibration``: the index of the probe before it); every
launch records its 1-min load average (``load_average``, sampled every 5 s).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
sys.path.insert(0, os.path.join(HERE, "..", "validate"))

from bench_conditions import LoadSampler, calibration  # noqa: E402
from mpi_launch import run_job  # noqa: E402
from predict_pd_offload import predict  # noqa: E402
from perf_paths import RESULTS  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402


def row(r: dict) -> dict:
    dec = [f for f in r["offload"] if f.get("role") == "decode"]
    pre = [f for f in r["offload"] if f.get("role") == "prefill"]
    trips = sum(f["trips"] for f in dec)
    trip_s = sum(f["trip_s"] for f in dec)
    exposed = sum(f["exposed_s"] for f in dec)
    return dict(seconds=r["seconds"], tokens_per_s=r["output_tokens"] / r["seconds"],
                max_batch=r["max_batch"], preemptions=r["preemptions"],
                offloaded=sum(f["started"] for f in dec), trips=trips,
                round_trip_ms=None if not trips else 1e3 * trip_s / trips,
                hidden_fraction=None if trip_s <= 0 else 1 - exposed / trip_s,
                prefill_serve_s=sum(f["serve_s"] for f in pre))


def median(rows: list[dict]) -> dict:
    out = {}
    for k in (k for k in rows[0] if k not in ("calibration", "load_average")):
        xs = [x[k] for x in rows if x[k] is not None]
        out[k] = statistics.median(xs) if xs else None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--output", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=35)
    ap.add_argument("--offload-blocks", type=int, default=21)
    ap.add_argument("--m", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calibrate", default=None, metavar="B,P,D",
                    help="before each launch and after the last, one traced bench50m probe run "
                         "of batch B, prompt P, D new tokens (the machine's speed for the prediction)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_pd_offload.json"))
    args = ap.parse_args()
    base = dict(num=args.num, prompt_len=args.prompt, output_len=args.output, m=args.m,
                block_size=args.block_size, num_blocks=args.num_blocks,
                offload_blocks=args.offload_blocks, max_num_seqs=args.num,
                max_num_batched_tokens=max(args.prompt, 64))
    runs = {"pd": [], "pd_offload": []}
    tokens, cals = {}, []
    order = [("pd", False), ("pd_offload", True)]
    for i in range(args.repeats):
        for name, off in (order if i % 2 == 0 else order[::-1]):  # alternating
            if args.calibrate:
                cals.append(calibration(args.calibrate))
            out = f"{args.out}.{name}.{i}.tmp.json"
            with LoadSampler() as ls:
                r = run_job(4, "pd_offload_bench_job.py", out, [json.dumps(dict(base, offload=off))])
            os.remove(out)
            tokens.setdefault(name, r["tokens"])
            load = statistics.mean(ls.samples)
            runs[name].append(dict(row(r), load_average=load,
                                   calibration=len(cals) - 1 if args.calibrate else None))
            print(f"  {name} launch {i + 1}/{args.repeats}: load average {load:.2f}", flush=True)
    if args.calibrate:
        cals.append(calibration(args.calibrate))
    same = tokens["pd"] == tokens["pd_offload"]
    rows = {k: median(v) for k, v in runs.items()}
    res = dict(config=base, repeats=args.repeats, rows=rows, runs=runs, calibrations=cals,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               tokens_identical=same, machine="2 shared CPU cores, 4 ranks")
    res["simulator"] = sim = predict(res)
    res["batch_gain"] = rows["pd_offload"]["max_batch"] / max(1, rows["pd"]["max_batch"])
    print(f"{'layout':12} {'max batch':>13} {'preempt':>7} {'tok/s':>15} {'offloaded':>9} "
          f"{'rt ms':>13} {'hidden':>6}   (measured / predicted)")
    for k, v in rows.items():
        p = sim["rows"][k]
        rt = "-" if v["round_trip_ms"] is None else f"{v['round_trip_ms']:.2f} / {p['round_trip_ms']:.2f}"
        hid = "-" if v["hidden_fraction"] is None else f"{100 * v['hidden_fraction']:.0f}%"
        print(f"{k:12} {v['max_batch']:>6.0f} / {p['max_batch']:<4.0f} {v['preemptions']:>7.0f} "
              f"{v['tokens_per_s']:>7.1f} / {p['tokens_per_s']:<5.1f} {v['offloaded']:>4.0f} / {p['offloaded']:<2} "
              f"{rt:>13} {hid:>6}")
    print(f"batch capacity gained: {res['batch_gain']:.2f}x; greedy tokens identical: {same}; "
          f"measured / predicted: {json.dumps(sim['measured_over_predicted'])}")
    write_json(args.out, res)
    if not same:
        raise SystemExit("greedy tokens differ between the layouts")


if __name__ == "__main__":
    main()
