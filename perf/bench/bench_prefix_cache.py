"""Prefix caching on a shared-prefix offline workload: prefill work and job time, off vs on,
on with a first tier too small (with and without the second tier), and over 2 attention
replicas, cache-aware vs round-robin routing.

    python perf/bench/bench_prefix_cache.py [--systems 8 --per-system 6 --system-len 128
                                       --suffix-len 16 --output-len 8 --threads 2
                                       --small-blocks 48 --host-kv-gib 0.25 --no-routing]

The workload (issue 20's, scaled to a 2-core CPU box): ``--systems`` system prompts of
``--system-len`` random tokens, ``--per-system`` requests each (the system prompt + a
``--suffix-len``-token random suffix), in a seeded shuffled order, greedy, eos ignored,
``--output-len`` new tokens. The model is the ~49M-parameter Mixtral-shaped ``bench50m``
(conf/model/bench50m.yaml) with dummy weights, in single mode, fp32 on CPU. The same engine
settings run with ``enable_prefix_caching`` off (the baseline) and on, alternating
``--repeats`` times after a warm-up; per side: prompt tokens the model computed
(``engine.num_computed_prompt_tokens``), the prefix hit rate (``RequestOutput
.num_cached_tokens`` / prompt tokens), and the job's wall time (median). The greedy tokens of
both sides must agree.

Small first tier: the same workload with ``--small-blocks`` KV blocks (too few to keep the
system prompts while requests run), caching on without a second tier and with one of
``--host-kv-gib`` (on CPU: safetensors files in a temporary directory; evicted prefixes come
back from there instead of being recomputed).

Routing (``perf/jobs/prefix_routing_job.py``, ``mpiexec -n 2 + --routing-experts``): 2 attention
replicas of ``--routing-blocks`` blocks each + expert ranks, disaggregated, a smaller workload
(``--routing-*``), one rank per process and one thread each; ``round_robin`` and
``cache_aware`` in the same launch, after a warm-up job: hit rate, job time, requests per
replica; greedy tokens must agree. Writes ``perf/results/bench_prefix_cache.json``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from prefix_workload import workload  # noqa: E402

from megainfer.bench.results_io import write_json  # noqa: E402
from megainfer.bench.shapes import BENCH50M  # noqa: E402

def run_once(a, on: bool, prompts, num_blocks=None, host_kv_gib=0.0):
    from megainfer import LLM, SamplingParams
    max_len = a.system_len + a.suffix_len + a.output_len
    llm = LLM(BENCH50M, seed=0, max_model_len=max_len,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              block_size=a.block_size, enable_prefix_caching=on, num_blocks=num_blocks,
              host_kv_gib=host_kv_gib)
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    eng = llm.engine
    P = sum(len(p) for p in prompts)
    cached = sum(o.num_cached_tokens for o in outs)
    return dict(seconds=dt, cpu_seconds=cpu, prompt_tokens=P, computed_prompt_tokens=eng.num_computed_prompt_tokens,
                cached_prompt_tokens=cached, hit_rate=cached / P, steps=eng.num_steps,
                preemptions=eng.num_preemptions, evictions=eng.blocks.num_evictions,
                num_blocks=eng.blocks.num_blocks,
                tier_blocks_loaded=eng.kv_tier.num_loaded if eng.kv_tier else 0,
                tier_blocks_saved=eng.kv_tier.num_saved if eng.kv_tier else 0
                ), [o.outputs[0].token_ids for o in outs]


def run_routing(a) -> dict:
    """Both routing policies in one mpiexec launch (perf/jobs/prefix_routing_job.py)."""
    import json
    import tempfile

    from mpi_launch import run_job
    opts = dict(systems=a.routing_systems, per_system=a.routing_per_system,
                system_len=a.routing_system_len, suffix_len=a.suffix_len,
                output_len=a.routing_output_len, block_size=a.block_size,
                max_num_seqs=a.routing_max_num_seqs, routing_blocks=a.routing_blocks,
                max_num_batched_tokens=a.max_num_batched_tokens, seed=a.seed,
                expert_ranks=a.routing_experts)
    with tempfile.TemporaryDirectory() as d:
        r = run_job(2 + a.routing_experts, "prefix_routing_job.py", os.path.join(d, "r.json"),
                    [json.dumps(opts)], timeout_s=3600)
    r["workload"] = opts
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--per-system", type=int, default=6)
    p.add_argument("--system-len", type=int, default=128)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small-blocks", type=int, default=48)
    p.add_argument("--host-kv-gib", type=float, default=0.25)
    p.add_argument("--no-routing", dest="routing", action="store_false")
    p.add_argument("--routing-systems", type=int, default=8)
    p.add_argument("--routing-per-system", type=int, default=6)
    p.add_argument("--routing-system-len", type=int, default=128)
    p.add_argument("--routing-output-len", type=int, default=8)
    p.add_argument("--routing-max-num-seqs", type=int, default=8)
    p.add_argument("--routing-blocks", type=int, default=72)
    p.add_argument("--routing-experts", type=int, default=1)
    p.add_argument("--out", default=os.path.join(RESULTS, "bench_prefix_cache.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    prompts = workload(a)
    load = os.getloadavg()
    run_once(a, True, prompts[:2])  # warm-up (allocator, kernels)
    sides = {"caching off": (False, None, 0.0), "caching on": (True, None, 0.0),
             "on, small pool": (True, a.small_blocks, 0.0),
             "on, small pool + tier": (True, a.small_blocks, a.host_kv_gib)}
    runs = {name: [] for name in sides}
    tokens = {}
    for _ in range(a.repeats):
        for name, (on, blocks, gib) in sides.items():
            r, toks = run_once(a, on, prompts, blocks, gib)
            runs[name].append(r)
            tokens[name] = toks
    agree = all(t == tokens["caching off"] for t in tokens.values())
    rows = {}
    for name in sides:
        rs = runs[name]
        rows[name] = dict(rs[0], seconds=statistics.median(r["seconds"] for r in rs),
                          seconds_all=[r["seconds"] for r in rs],
                          cpu_seconds=statistics.median(r["cpu_seconds"] for r in rs))
    off, on = rows["caching off"], rows["caching on"]
    prefill_ratio = off["computed_prompt_tokens"] / max(on["computed_prompt_tokens"], 1)
    time_ratio = off["seconds"] / on["seconds"]
    print(f"workload: {a.systems} system prompts x {a.system_len} tokens, {a.per_system} requests "
          f"each (+{a.suffix_len}-token suffix), {a.output_len} new tokens; bench50m fp32 CPU, "
          f"{a.threads} threads, block {a.block_size}, budget {a.max_num_batched_tokens}")
    hdr = (f"{'':<22} {'blocks':>6} {'prefill tok':>12} {'hit rate':>9} {'job s':>8} "
           f"{'cpu s':>8} {'steps':>6} {'preempt':>8} {'tier in':>8}")
    print(hdr)
    for name, r in rows.items():
        print(f"{name:<22} {r['num_blocks']:>6} {r['computed_prompt_tokens']:>12} "
              f"{100 * r['hit_rate']:>8.1f}% {r['seconds']:>8.2f} {r['cpu_seconds']:>8.2f} "
              f"{r['steps']:>6} "
              f"{r['preemptions']:>8} {r['tier_blocks_loaded']:>8}")
    small, tier = rows["on, small pool"], rows["on, small pool + tier"]
    tier_ratio = small["computed_prompt_tokens"] / max(tier["computed_prompt_tokens"], 1)
    print(f"small first tier: the second tier cuts prefill work {tier_ratio:.2f}x, job time "
          f"{small['seconds'] / tier['seconds']:.2f}x (cpu {small['cpu_seconds'] / tier['cpu_seconds']:.2f}x)")
    routing = run_routing(a) if a.routing else None
    if routing:
        rr, ca = routing["round_robin"], routing["cache_aware"]
        w = routing["workload"]
        print(f"2 attention replicas + {a.routing_experts} expert rank(s), disaggregated: "
              f"{w['systems']} x {w['system_len']}-token system prompts, {w['per_system']} "
              f"requests each, {w['output_len']} new tokens, {w['routing_blocks']} blocks/replica")
        print(f"{'routing':<12} {'hit rate':>9} {'job s':>8} {'cpu s':>8} {'per replica':>12}")
        for name, r in (("round_robin", rr), ("cache_aware", ca)):
            print(f"{name:<12} {100 * r['hit_rate']:>8.1f}% {r['seconds']:>8.2f} "
                  f"{r['cpu_seconds']:>8.2f} {str(r['assigned']):>12}")
        routing["hit_rate_ratio"] = ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else None
        routing["job_time_ratio"] = rr["seconds"] / ca["seconds"]
        routing["greedy_token_agreement"] = rr.pop("tokens") == ca.pop("tokens")
        ratio = routing["hit_rate_ratio"]
        print(f"cache-aware hit rate {'-' if ratio is None else f'{ratio:.2f}'}x round robin's "
              f"(goal >= 1.5x), job {routing['job_time_ratio']:.2f}x shorter; greedy tokens agree: "
              f"{routing['greedy_token_agreement']}")
    cpu_ratio = off["cpu_seconds"] / on["cpu_seconds"]
    print(f"prefill work: {prefill_ratio:.2f}x less (goal >= 3x); job time: {time_ratio:.2f}x "
          f"shorter (goal >= 1.5x; cpu time {cpu_ratio:.2f}x); greedy tokens agree: {agree}")
    result = dict(
        name="bench_prefix_cache", date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), processor=platform.processor(),
                     cpu_count=os.cpu_count(), python=sys.version.split()[0],
                     torch=torch.__version__, load_average=load),
        args=vars(a), model="bench50m (dummy weights)", results=rows,
        prefill_work_ratio=prefill_ratio, job_time_ratio=time_ratio, cpu_time_ratio=cpu_ratio,
        goals=dict(prefill_work_ratio=3.0, job_time_ratio=1.5, routing_hit_rate_ratio=1.5),
        greedy_token_agreement=agree, baseline="the same engine with enable_prefix_caching=False",
        second_tier_prefill_ratio=tier_ratio, routing=routing)
    write_json(a.out, result, indent=2)


if __name__ == "__main__":
    main()
