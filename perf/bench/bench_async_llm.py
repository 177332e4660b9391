"""Online vs offline throughput, single mode: one mixed-length job through ``LLM.generate`` (all
requests up front) and through ``AsyncLLM`` (requests arriving one at a time), in one run.

    python perf/bench/bench_async_llm.py [--requests 48 --repeats 3 --gap-ms 0]

Same checkpoint (a tiny Qwen3-MoE made by megainfer.tools.make_tiny, random weights), same
arguments for both engines (two instances, prefix caching on in both, no prompt shared), greedy,
eos ignored; prompt lengths and output lengths drawn at random per request. AsyncLLM's client
starts one ``generate`` per request, one after another (``--gap-ms`` apart; 0: as fast as the
client can), and consumes every stream; its time runs from the first arrival to the last
output. Each side runs ``--repeats`` times, alternating; the table shows medians and the ratio
of output tokens/s (goal: AsyncLLM within 5% of LLM.generate). Also reported: the CPU the idle
AsyncLLM process uses over one second (its engine core asleep), and whether the two sides'
tokens agree. Writes ``perf/results/bench_async_llm.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402

from megainfer.bench.results_io import write_json  # noqa: E402


def make_job(a):
    g = torch.Generator().manual_seed(0)
    ins = torch.randint(a.min_input, a.max_input + 1, (a.requests,), generator=g).tolist()
    outs = torch.randint(a.min_output, a.max_output + 1, (a.requests,), generator=g).tolist()
    prompts = [torch.randint(3, a.vocab, (n,), generator=g).tolist() for n in ins]
    return prompts, outs


def run_offline(llm, prompts, params):
    t, c = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, time.process_time() - c, [o.outputs[0].token_ids for o in outs]


def run_online(engine, prompts, params, gap_s: float):
    tokens, yields = [None] * len(prompts), [0]

    async def one(i):
        async for out in engine.generate(prompts[i], params[i]):
            yields[0] += 1
        tokens[i] = out.outputs[0].token_ids

    async def job():
        tasks = []
        for i in range(len(prompts)):  # requests arrive one at a time
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(gap_s)
        await asyncio.gather(*tasks)

    t, c = time.perf_counter(), time.process_time()
    asyncio.run(job())
    return time.perf_counter() - t, time.process_time() - c, tokens, yields[0]


def idle_cpu(seconds: float = 1.0) -> float:
    """Cores' worth of CPU this process used over ``seconds`` of wall time."""
    t0, w0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - t0) / (time.perf_counter() - w0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--min-input", type=int, default=8)
    ap.add_argument("--max-input", type=int, default=160)
    ap.add_argument("--min-output", type=int, default=8)
    ap.add_argument("--max-output", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_async_llm.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from megainfer import LLM, AsyncLLM, SamplingParams
    from megainfer.tools.make_tiny import make_tiny

    prompts, lens = make_job(a)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    kw = dict(max_model_len=a.max_input + a.max_output, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens)
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny("qwen3_moe", d, seed=0, vocab=a.vocab, hidden=a.hidden, layers=a.layers,
                         experts=a.experts, inter=2 * a.hidden)
        llm, online = LLM(path, **kw), AsyncLLM(path, **kw)
    warm = [SamplingParams(temperature=0, max_tokens=4)] * 2
    run_offline(llm, prompts[:2], warm)
    run_online(online, prompts[:2], warm, 0.0)
    off_t, on_t, off_c, on_c, agree, yields = [], [], [], [], [], 0
    for r in range(a.repeats):
        dt, cpu, off_tok = run_offline(llm, prompts, params)
        off_t.append(dt)
        off_c.append(cpu)
        dt, cpu, on_tok, yields = run_online(online, prompts, params, a.gap_ms / 1e3)
        on_t.append(dt)
        on_c.append(cpu)
        agree.append(sum(x == y for p, q in zip(off_tok, on_tok) for x, y in zip(p, q)) /
                     sum(lens))
        print(f"  repeat {r}: LLM.generate {off_t[-1]:.2f}s ({off_c[-1]:.2f} CPU s)  AsyncLLM "
              f"{on_t[-1]:.2f}s ({on_c[-1]:.2f} CPU s)", flush=True)
    cpu = idle_cpu()
    online.shutdown()
    tokens = sum(lens)
    rows = {}
    for name, ts, cs in (("LLM.generate (all up front)", off_t, off_c),
                         ("AsyncLLM (one at a time)", on_t, on_c)):
        med = statistics.median(ts)
        rows[name] = dict(seconds_median=med, seconds_min=min(ts), seconds=ts,
                          cpu_seconds_median=statistics.median(cs), cpu_seconds=cs,
                          output_tokens_per_s=tokens / med,
                          output_tokens_per_s_best=tokens / min(ts))
    off, on = rows["LLM.generate (all up front)"], rows["AsyncLLM (one at a time)"]
    ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    ratio_best = on["output_tokens_per_s_best"] / off["output_tokens_per_s_best"]
    pair = statistics.median(o / n for o, n in zip(off_t, on_t))
    cpu_ratio = on["cpu_seconds_median"] / off["cpu_seconds_median"]
    load = os.getloadavg()
    print(f"\n{a.requests} requests, {a.min_input}-{a.max_input} tokens in, {a.min_output}-"
          f"{a.max_output} out ({tokens} output tokens), {a.threads} thread(s), load average "
          f"{load[0]:.1f}")
    print(f"{'':<30}{'median s':>10}{'min s':>8}{'out tok/s':>12}{'CPU s':>8}")
    for name, r in rows.items():
        print(f"{name:<30}{r['seconds_median']:>10.2f}{r['seconds_min']:>8.2f}"
              f"{r['output_tokens_per_s']:>12.1f}{r['cpu_seconds_median']:>8.2f}")
    print(f"AsyncLLM / LLM.generate throughput: {ratio:.3f} on medians, {ratio_best:.3f} on best "
          f"runs, {pair:.3f} median of per-repeat pairs (goal >= 0.95); {yields} streamed "
          f"outputs in the last run; tokens equal: {100 * min(agree):.1f}%")
    print(f"CPU seconds AsyncLLM / LLM.generate: {cpu_ratio:.3f} (the steadier figure on a loaded "
          f"machine: wall time there is mostly waiting for a core)")
    print(f"idle AsyncLLM process: {100 * cpu:.2f}% of a core (goal < 5%)")
    result = dict(
        name="bench_async_llm", date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), processor=platform.processor(),
                     cpu_count=os.cpu_count(), python=sys.version.split()[0],
                     torch=torch.__version__, load_average=load),
        args=vars(a), output_tokens=tokens, results=rows, throughput_ratio=ratio,
        throughput_ratio_best=ratio_best, throughput_ratio_pairs=pair, cpu_seconds_ratio=cpu_ratio,
        streamed_outputs=yields, token_agreement=min(agree), idle_cpu_fraction=cpu,
        baseline="LLM.generate with the same requests up front, same arguments, same run")
    write_json(a.out, result, indent=2)


if __name__ == "__main__":
    main()
