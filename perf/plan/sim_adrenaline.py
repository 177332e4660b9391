"""A paper-scale projection of the decode-attention offload (``pd.offload``, docs/pd.md) against
Adrenaline's reported 1.68x output throughput (/work/shared/seeds/000, section 7: ShareGPT,
Llama-2 7B, prefill and decode instances on separate GPUs), through the PD simulator
(``sim.pd.simulate_pd_job`` with ``sim.pd_offload``) on datasheet profiles.

    python perf/plan/sim_adrenaline.py [--profiles a100_80g] [--rates 8 12 16 20 24]
        [--requests 800] [--tpot-slo-ms 100] [--ttft-slo-ms 2000] [--max-num-seqs 512]
        [--out perf/results/sim_adrenaline.json]

The deployment: one prefill replica (1 GPU, whole model) and one decode replica. The
simulator's decode pool is attention replicas + expert ranks, so the dense FFN runs as one
expert (``conf/plan_model/llama2_7b.yaml``) on a second GPU with m = 1 (the two sides take
turns, as one colocated instance's kernels do, plus an A2E/E2A hop per layer): three GPUs where
Adrenaline has two. The decode replica's KV cache is what a whole-model instance on one GPU
holds beside its weights (``world_serving.replica_kv_tokens``, the vLLM decode instance's), the
prefill replica's offload pool half of its own (``offload_pool_blocks``, ``pd.offload_blocks``'
default). Workload: Poisson arrivals, ShareGPT-like lengths (assumed, not measured: prompt
lognormal median 160 sigma 1.0, output median 200 sigma 0.9, each clipped to 2048; means
about 260 and 300), the same requests for every ratio at one rate. A request meets the SLOs
when its TTFT and TPOT are within them (``plan.goodput.attainment``, p90); the throughput at
the SLO of a variant is the largest output tokens/s over the rates where it holds. Variants
(``variants``): plain PD; ratios 0.5 and 1 as this runtime answers (a busy prefill replica
between its layers, ``Offload.layer_wait`` 0.5); ratio 1 with no layer wait (the offloaded
attention beside the prefill, as Adrenaline's SM partition runs it); ``pd.offload_policy=auto``
with the TPOT SLO, with and without the wait. Printed per profile and variant: that throughput,
the rate, and its ratio to plain PD, beside Adrenaline's 1.68x.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402
from megainfer.bench.shapes import load_shape  # noqa: E402
from megainfer.perfmodel.model.disagg import Plan, Workload  # noqa: E402
from megainfer.perfmodel.model.hardware import load_hardware  # noqa: E402
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model  # noqa: E402
from megainfer.perfmodel.plan.goodput import Slo, attainment  # noqa: E402
from megainfer.perfmodel.plan.world_serving import offload_pool_blocks, replica_kv_tokens  # noqa: E402
from megainfer.perfmodel.sim.events import LengthDist, poisson_requests  # noqa: E402
from megainfer.perfmodel.sim.job import JobConfig  # noqa: E402
from megainfer.perfmodel.sim.pd import simulate_pd_job  # noqa: E402
from megainfer.perfmodel.sim.pd_offload import Offload  # noqa: E402

MODEL, DTYPE = "llama2_7b", "bfloat16"
PROMPT = LengthDist("lognormal", 160, hi=2048, sigma=1.0)
OUTPUT = LengthDist("lognormal", 200, hi=2048, sigma=0.9)
PAPER = {"figure": 1.68, "source": "Adrenaline as quoted in /work/shared/seeds/000 (section 7): "
         "output throughput vs vLLM PD, ShareGPT + Llama-2 7B"}


def variants(blocks: int, slo: Slo) -> dict:
    """label -> the offload simulated (plain PD first, the baseline): fixed ratios with this
    runtime's answer between prefill layers (``layer_wait`` 0.5), ratio 1 with the offloaded
    attention running beside the prefill (0: Adrenaline's SM partition), and ``auto``
    (``offload_rule.picks_auto``, the TPOT SLO) with each."""
    return {"PD": Offload(),
            "ratio 0.5": Offload(0.5, blocks),
            "ratio 1": Offload(1.0, blocks),
            "ratio 1, no layer wait": Offload(1.0, blocks, layer_wait=0.0),
            "auto": Offload(0.0, blocks, policy="auto", tpot_slo_s=slo.tpot_s),
            "auto, no layer wait": Offload(0.0, blocks, policy="auto", tpot_slo_s=slo.tpot_s, layer_wait=0.0)}


def run_rate(pool, model, plan, cfg, rate: float, n: int, off: Offload, kv: int, slo: Slo) -> dict:
    """One simulated job at ``rate`` req/s under ``off``."""
    reqs = poisson_requests(n, rate, PROMPT, OUTPUT, seed=1)
    r = simulate_pd_job(pool, model, plan, reqs, cfg, DTYPE, offload=off, decode_kv_tokens=kv)
    a = attainment(r.arrival_s, r.ttft_s, r.tpot_s, r.finish_s, slo)
    batch = np.array([x[2] for x in r.iteration_s])
    return dict(rate=rate, tokens_per_s=r.throughput_tok_s, meets_slo=a.ok, met_fraction=a.fraction,
                ttft_p90_ms=1e3 * a.ttft_p, tpot_p90_ms=1e3 * a.tpot_p,
                tpot_p50_ms=1e3 * float(np.nanmedian(r.tpot_s)),
                mean_decode_batch=float(batch.mean()), max_decode_batch=float(batch.max()),
                offloaded=float(r.offloaded.mean()),
                round_trip_ms=1e3 * float(r.round_trip_s.mean()) if len(r.round_trip_s) else None)


def project(profile: str, a) -> dict:
    hw, shape = load_hardware(profile), load_shape(MODEL)
    mean_p, mean_o = (int(d.sample(np.random.default_rng(0), 100000).mean()) for d in (PROMPT, OUTPUT))
    pool = PrefillPool(shape, hw, 1, 1, DTYPE)
    model = decode_model(shape, hw, hw, Workload(mean_p, mean_o), DTYPE, True)
    plan = Plan(1, 1, 1, 1, 1, a.max_num_seqs, hw.name, hw.name)
    cfg = JobConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.prefill_tokens)
    kv_tokens = replica_kv_tokens(shape, hw, 1, DTYPE)
    kv, blocks = int(kv_tokens), offload_pool_blocks(kv_tokens)
    slo = Slo(a.ttft_slo_ms / 1e3, a.tpot_slo_ms / 1e3)
    out = {"decode_kv_tokens": kv, "offload_pool_blocks": blocks, "mean_prompt": mean_p,
           "mean_output": mean_o, "variants": {}}
    for label, off in variants(blocks, slo).items():
        runs = [run_rate(pool, model, plan, cfg, rate, a.requests, off, kv, slo) for rate in a.rates]
        ok = [x for x in runs if x["meets_slo"]]
        out["variants"][label] = {"runs": runs, "at_slo": max(ok, key=lambda x: x["tokens_per_s"]) if ok else None}
    base = out["variants"]["PD"]["at_slo"]
    for v in out["variants"].values():
        v["gain"] = (v["at_slo"]["tokens_per_s"] / base["tokens_per_s"]) if v["at_slo"] and base else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", nargs="+", default=["a100_80g"])
    ap.add_argument("--rates", nargs="+", type=float, default=[8, 12, 16, 20, 24])
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--tpot-slo-ms", type=float, default=100.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join(RESULTS, "sim_adrenaline.json"))
    a = ap.parse_args()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "args": vars(a), "model": MODEL, "paper": PAPER, "profiles": {}}
    print(f"{'profile':9} {'variant':22} {'tok/s at SLO':>12} {'rate':>5} {'TPOT p90':>9} {'batch':>6} "
          f"{'offloaded':>9} {'rt/layer':>9} {'gain':>6}  (Adrenaline: {PAPER['figure']}x)")
    for prof in a.profiles:
        p = res["profiles"][prof] = project(prof, a)
        for label, v in p["variants"].items():
            b = v["at_slo"]
            if b is None:
                print(f"{prof:9} {label:22}  no rate meets the SLOs")
                continue
            rt = "-" if b["round_trip_ms"] is None else f"{1e3 * b['round_trip_ms']:.0f} us"
            print(f"{prof:9} {label:22} {b['tokens_per_s']:12.0f} {b['rate']:5.0f} {b['tpot_p90_ms']:7.1f}ms "
                  f"{b['mean_decode_batch']:6.0f} {100 * b['offloaded']:8.0f}% {rt:>9} {v['gain']:5.2f}x")
        print(f"{prof:9} decode KV {p['decode_kv_tokens']} tokens, offload pool {p['offload_pool_blocks']} "
              f"blocks, mean prompt {p['mean_prompt']}, output {p['mean_output']}")
    write_json(a.out, res)


if __name__ == "__main__":
    main()
