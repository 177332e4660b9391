"""Job time at a KV-bound batch (helper of ``perf/bench/bench_kv_quant.py``).

The same offline job (``--job-requests`` random prompts of ``--job-prompt`` tokens, greedy,
eos ignored, ``--job-output`` new tokens) runs on the CPU engine (``LLM``, single mode, the
~49M-parameter Mixtral-shaped bench50m with dummy weights, fp32) once per
``cache.kv_cache_dtype`` at one ``kv_cache_memory_gib``, sized so that the full-precision cache
holds ``--job-auto-seqs`` whole requests while ``max_num_seqs`` would allow all of them: the
batch is bound by KV blocks. Per format: the blocks the budget buys, the whole requests they
hold, the most requests admitted at once (peak of the scheduler's running set: a request is
admitted once its prompt's blocks are free, and preempted when a decode finds none),
preemptions, steps, generated tokens per step (the real decode batch), job wall time, this
process's CPU time (steadier than wall time on a shared box) and generated tokens/s; against the
full-precision run's greedy tokens, the share of requests whose whole output is the same and the
mean tokens before the first difference. Prefix caching is off (random prompts share nothing).
The default job is decode-heavy (short prompts, longer outputs): decode steps are where the
batch size pays.
"""
from __future__ import annotations

import random
import time

import torch

from megainfer.bench.shapes import BENCH50M
from megainfer.engine.sizing import kv_bytes_per_block

FORMATS = ("auto", "fp8_e4m3", "fp4_e2m1")
GRANULARITY = "token_head"  # cache.kv_scale_granularity of the quantised rows (the default)


def _budget_gib(cfg, a, BS: int) -> float:
    per_req = -(-(a.job_prompt + a.job_output) // BS)
    return a.job_auto_seqs * per_req * kv_bytes_per_block(cfg, BS, torch.float32) / 2**30


def run_job(a, BS: int = 16) -> dict:
    from megainfer import LLM, SamplingParams
    cfg = BENCH50M
    g = random.Random(0)
    prompts = [[g.randrange(3, cfg.vocab_size) for _ in range(a.job_prompt)]
               for _ in range(a.job_requests)]
    max_len = a.job_prompt + a.job_output
    gib = _budget_gib(cfg, a, BS)
    sp = SamplingParams(temperature=0, max_tokens=a.job_output, ignore_eos=True)
    out, ref_tokens = {"kv_cache_memory_gib": gib, "requests": a.job_requests,
                       "kv_scale_granularity": GRANULARITY,
                       "prompt_len": a.job_prompt, "output_len": a.job_output, "formats": {}}, None
    for fmt in FORMATS:
        llm = LLM(cfg, seed=0, device="cpu", dtype="float32", max_model_len=max_len,
                  max_num_seqs=a.job_requests, max_num_batched_tokens=a.job_batched_tokens,
                  block_size=BS, kv_cache_memory_gib=gib, kv_cache_dtype=fmt,
                  enable_prefix_caching=False, kv_scale_granularity=GRANULARITY)
        eng = llm.engine
        blocks = llm.cache_config.num_blocks
        reqs = [eng.add_request(i, prompt_token_ids=p, params=sp) for i, p in enumerate(prompts)]
        peak, t0, c0 = 0, time.perf_counter(), time.process_time()
        while eng.has_unfinished():
            eng.step()
            peak = max(peak, len(eng.scheduler.running))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = [list(r.output_token_ids) for r in reqs]
        ref_tokens = ref_tokens or tokens
        # greedy continuations diverge for good after one different token: count the tokens
        # before each request's first difference, and the requests with no difference
        agree = [next((i for i, (x, y) in enumerate(zip(r, q)) if x != y), len(q))
                 for r, q in zip(ref_tokens, tokens)]
        gen = sum(len(t) for t in tokens)
        out["formats"][fmt] = {"blocks": blocks, "max_seqs": blocks // -(-max_len // BS),
                               "budget_blocks": int(gib * 2**30 // kv_bytes_per_block(
                                   cfg, BS, torch.float32, kv_cache_dtype=fmt,
                                   kv_scale_granularity=GRANULARITY)),
                               "peak_running": peak, "preemptions": eng.num_preemptions,
                               "steps": eng.num_steps, "job_s": dt, "job_cpu_s": cpu,
                               "tokens_per_s": gen / dt, "tokens_per_step": gen / eng.num_steps,
                               "requests_equal_auto": sum(n == a.job_output for n in agree)
                               / len(agree),
                               "mean_tokens_before_divergence": sum(agree) / len(agree)}
    base = out["formats"]["auto"]
    for r in out["formats"].values():
        r["blocks_x"] = r["budget_blocks"] / base["budget_blocks"]
        r["job_speedup"] = base["job_s"] / r["job_s"]
        r["job_cpu_speedup"] = base["job_cpu_s"] / r["job_cpu_s"]
    return out


def print_job(job: dict) -> None:
    print(f"\njob at a KV-bound batch: {job['requests']} requests x ({job['prompt_len']} prompt + "
          f"{job['output_len']} out), bench50m fp32 on CPU, kv_cache_memory_gib="
          f"{job['kv_cache_memory_gib']:.4f}")
    print("(blocks: what the budget buys; used: capped at max_num_seqs whole requests)")
    print(f"{'kv_cache_dtype':<16}{'blocks':>8}{'x':>6}{'used':>6}{'max seqs':>10}{'peak adm':>10}"
          f"{'preempt':>9}{'steps':>7}{'tok/step':>9}{'job s':>8}{'cpu s':>8}{'tok/s':>8}"
          f"{'speedup':>9}{'cpu spd':>9}{'same req':>9}{'tok<diff':>9}")
    for fmt, r in job["formats"].items():
        print(f"{fmt:<16}{r['budget_blocks']:>8}{r['blocks_x']:>6.2f}{r['blocks']:>6}"
              f"{r['max_seqs']:>10}{r['peak_running']:>10}{r['preemptions']:>9}{r['steps']:>7}"
              f"{r['tokens_per_step']:>9.2f}{r['job_s']:>8.2f}{r['job_cpu_s']:>8.2f}"
              f"{r['tokens_per_s']:>8.1f}{r['job_speedup']:>9.2f}{r['job_cpu_speedup']:>9.2f}"
              f"{r['requests_equal_auto']:>9.2f}{r['mean_tokens_before_divergence']:>9.1f}")
