"""Prefix caching on a shared-prefix offline workload: prefill work and job time, off vs on.

    python perf/bench_prefix_cache.py [--systems 8 --per-system 8 --system-len 256
                                       --suffix-len 16 --output-len 16 --threads 2]

The workload (issue 20's, scaled to a 2-core CPU box): ``--systems`` system prompts of
``--system-len`` random tokens, ``--per-system`` requests each (the system prompt + a
``--suffix-len``-token random suffix), in a seeded shuffled order, greedy, eos ignored,
``--output-len`` new tokens. The model is the ~49M-parameter Mixtral-shaped ``bench50m``
(conf/model/bench50m.yaml) with dummy weights, in single mode, fp32 on CPU. The same engine
settings run with ``enable_prefix_caching`` off (the baseline) and on, alternating
``--repeats`` times after a warm-up; per side: prompt tokens the model computed
(``engine.num_computed_prompt_tokens``), the prefix hit rate (``RequestOutput
.num_cached_tokens`` / prompt tokens), and the job's wall time (median). The greedy tokens of
both sides must agree. Writes ``perf/results/bench_prefix_cache.json``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_io import write_json  # noqa: E402

BENCH50M = dict(family="mixtral", vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8,
                num_kv_heads=4, head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=768,
                max_position_embeddings=2048, bos_token_id=1, eos_token_id=(2,))


def workload(a) -> list[list[int]]:
    g = random.Random(a.seed)
    systems = [[g.randrange(3, 8192) for _ in range(a.system_len)] for _ in range(a.systems)]
    prompts = [s + [g.randrange(3, 8192) for _ in range(a.suffix_len)]
               for s in systems for _ in range(a.per_system)]
    g.shuffle(prompts)
    return prompts


def run_once(a, on: bool, prompts):
    from megainfer import LLM, SamplingParams
    from megainfer.config import ModelConfig
    max_len = a.system_len + a.suffix_len + a.output_len
    llm = LLM(ModelConfig(**BENCH50M), seed=0, max_model_len=max_len,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              block_size=a.block_size, enable_prefix_caching=on)
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    eng = llm.engine
    P = sum(len(p) for p in prompts)
    cached = sum(o.num_cached_tokens for o in outs)
    return dict(seconds=dt, prompt_tokens=P, computed_prompt_tokens=eng.num_computed_prompt_tokens,
                cached_prompt_tokens=cached, hit_rate=cached / P, steps=eng.num_steps,
                preemptions=eng.num_preemptions, evictions=eng.blocks.num_evictions,
                num_blocks=eng.blocks.num_blocks), [o.outputs[0].token_ids for o in outs]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--per-system", type=int, default=8)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_prefix_cache.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    prompts = workload(a)
    load = os.getloadavg()
    run_once(a, True, prompts[:2])  # warm-up (allocator, kernels)
    runs = {False: [], True: []}
    tokens = {}
    for _ in range(a.repeats):
        for on in (False, True):
            r, toks = run_once(a, on, prompts)
            runs[on].append(r)
            tokens[on] = toks
    agree = tokens[False] == tokens[True]
    rows = {}
    for on, name in ((False, "caching off"), (True, "caching on")):
        rs = runs[on]
        rows[name] = dict(rs[0], seconds=statistics.median(r["seconds"] for r in rs),
                          seconds_all=[r["seconds"] for r in rs])
    off, on = rows["caching off"], rows["caching on"]
    prefill_ratio = off["computed_prompt_tokens"] / max(on["computed_prompt_tokens"], 1)
    time_ratio = off["seconds"] / on["seconds"]
    print(f"workload: {a.systems} system prompts x {a.system_len} tokens, {a.per_system} requests "
          f"each (+{a.suffix_len}-token suffix), {a.output_len} new tokens; bench50m fp32 CPU, "
          f"{a.threads} threads, block {a.block_size}, budget {a.max_num_batched_tokens}")
    hdr = f"{'':<12} {'prefill tok':>12} {'hit rate':>9} {'job s':>8} {'steps':>6} {'preempt':>8}"
    print(hdr)
    for name, r in rows.items():
        print(f"{name:<12} {r['computed_prompt_tokens']:>12} {100 * r['hit_rate']:>8.1f}% "
              f"{r['seconds']:>8.2f} {r['steps']:>6} {r['preemptions']:>8}")
    print(f"prefill work: {prefill_ratio:.2f}x less (goal >= 3x); job time: {time_ratio:.2f}x "
          f"shorter (goal >= 1.5x); greedy tokens agree: {agree}")
    result = dict(
        name="bench_prefix_cache", date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), processor=platform.processor(),
                     cpu_count=os.cpu_count(), python=sys.version.split()[0],
                     torch=torch.__version__, load_average=load),
        args=vars(a), model="bench50m (dummy weights)", results=rows,
        prefill_work_ratio=prefill_ratio, job_time_ratio=time_ratio,
        goals=dict(prefill_work_ratio=3.0, job_time_ratio=1.5),
        greedy_token_agreement=agree, baseline="the same engine with enable_prefix_caching=False")
    write_json(a.out, result, indent=2)


if __name__ == "__main__":
    main()
