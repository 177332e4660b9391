"""Online vs offline throughput in each deploy mode: one mixed-length job through
``LLM.generate`` (all requests up front) and through ``AsyncLLM`` (requests arriving one at a
time), in one run, for every ``--deploy`` mode (single in this process; the others start their
ranks as an mpiexec child job from this plain script, as a user's would).

    python perf/bench/bench_async_llm.py [--deploy single,a1e2 --requests 48 --repeats 3 --gap-ms 0]

Same checkpoint (a tiny Qwen3-MoE made by megainfer.tools.make_tiny, random weights), same
arguments for both engines (two instances, prefix caching on in both, no prompt shared), greedy,
eos ignored; prompt lengths and output lengths drawn at random per request. AsyncLLM's client
starts one ``generate`` per request, one after another (``--gap-ms`` apart; 0: as fast as the
client can), and consumes every stream; its time runs from the first arrival to the last
output. Each side runs ``--repeats`` times, alternating; the table shows medians and the ratio
of output tokens/s (goal: AsyncLLM within 5% of LLM.generate). Also reported: the CPU the idle
AsyncLLM process uses over one second (its engine core asleep), and whether the two sides'
tokens agree; in a distributed mode, each rank's CPU over one idle second (from /proc), and the
mode's offline throughput against single mode's. Writes ``perf/results/bench_async_llm.json``.
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

from megainfer.bench.process_cpu import cpu_seconds, idle_cpu  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402


def make_job(a):
    g = torch.Generator().manual_seed(0)
    ins = torch.randint(a.min_input, a.max_input + 1, (a.requests,), generator=g).tolist()
    outs = torch.randint(a.min_output, a.max_output + 1, (a.requests,), generator=g).tolist()
    prompts = [torch.randint(3, a.vocab, (n,), generator=g).tolist() for n in ins]
    return prompts, outs


def run_offline(llm, pids, prompts, params):
    t, c = time.perf_counter(), cpu_of(pids)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, cpu_of(pids) - c, [o.outputs[0].token_ids for o in outs]


def run_online(engine, pids, prompts, params, gap_s: float):
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

    t, c = time.perf_counter(), cpu_of(pids)
    asyncio.run(job())
    return time.perf_counter() - t, cpu_of(pids) - c, tokens, yields[0]


def cpu_of(pids) -> float:
    """CPU seconds used so far by these processes (every thread)."""
    return sum(cpu_seconds(p) for p in pids)


def rank_pids(core) -> list[int]:
    """The processes an engine core runs in (and this one, the frontend): in single mode this
    process; else also its child job's ranks."""
    return [os.getpid()] + [r.pid for r in getattr(core, "ranks", ())]


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
    ap.add_argument("--deploy", default="single,a1e2", help="comma list of conf/deploy presets")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_async_llm.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from megainfer import LLM, AsyncLLM, SamplingParams
    from megainfer.tools.make_tiny import make_tiny

    prompts, lens = make_job(a)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    kw = dict(max_model_len=a.max_input + a.max_output, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, cpu_threads=a.threads)
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny("qwen3_moe", d, seed=0, vocab=a.vocab, hidden=a.hidden, layers=a.layers,
                         experts=a.experts, inter=2 * a.hidden)
        modes = {m: measure_mode(a, LLM(path, deploy=m, **kw), AsyncLLM(path, deploy=m, **kw),
                                 prompts, params, lens) for m in a.deploy.split(",")}
    load = os.getloadavg()
    tokens = sum(lens)
    print(f"\n{a.requests} requests, {a.min_input}-{a.max_input} tokens in, {a.min_output}-"
          f"{a.max_output} out ({tokens} output tokens), {a.threads} thread(s) per rank, load "
          f"average {load[0]:.1f}")
    print(f"{'mode':<9}{'':<30}{'median s':>10}{'min s':>8}{'out tok/s':>12}{'CPU s':>8}")
    first = next(iter(modes.values()))
    for mode, m in modes.items():
        for name, r in m["results"].items():
            print(f"{mode:<9}{name:<30}{r['seconds_median']:>10.2f}{r['seconds_min']:>8.2f}"
                  f"{r['output_tokens_per_s']:>12.1f}{r['cpu_seconds_median']:>8.2f}")
        m["offline_vs_first_mode"] = (m["results"][OFFLINE]["output_tokens_per_s"] /
                                      first["results"][OFFLINE]["output_tokens_per_s"])
        print(f"{mode}: AsyncLLM / LLM.generate throughput {m['throughput_ratio']:.3f} on "
              f"medians, {m['throughput_ratio_pairs']:.3f} median of per-repeat pairs (goal >= "
              f"0.95); CPU seconds {m['cpu_seconds_ratio']:.3f}; tokens equal "
              f"{100 * m['token_agreement']:.1f}%; {m['streamed_outputs']} streamed outputs; "
              f"idle CPU per process (frontend, ranks) "
              f"{', '.join(f'{100 * c:.2f}%' for c in m['idle_cpu_fraction'])} (goal < 5%); "
              f"offline throughput {m['offline_vs_first_mode']:.3f}x {next(iter(modes))}'s")
    result = dict(
        name="bench_async_llm", date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), processor=platform.processor(),
                     cpu_count=os.cpu_count(), python=sys.version.split()[0],
                     torch=torch.__version__, load_average=load),
        args=vars(a), output_tokens=tokens, modes=modes,
        baseline="LLM.generate with the same requests up front, same arguments, same run; "
                 "each mode's offline throughput against the first mode's")
    write_json(a.out, result, indent=2)


OFFLINE, ONLINE = "LLM.generate (all up front)", "AsyncLLM (one at a time)"


def measure_mode(a, llm, online, prompts, params, lens) -> dict:
    """One mode's repeats, alternating the two sides; both engines closed at the end."""
    from megainfer import SamplingParams
    off_pids, on_pids = rank_pids(llm._core.core if llm._core else None), rank_pids(online._core)
    warm = [SamplingParams(temperature=0, max_tokens=4)] * 2
    run_offline(llm, off_pids, prompts[:2], warm)
    run_online(online, on_pids, prompts[:2], warm, 0.0)
    off_t, on_t, off_c, on_c, agree, yields = [], [], [], [], [], 0
    for r in range(a.repeats):
        dt, cpu, off_tok = run_offline(llm, off_pids, prompts, params)
        off_t.append(dt)
        off_c.append(cpu)
        dt, cpu, on_tok, yields = run_online(online, on_pids, prompts, params, a.gap_ms / 1e3)
        on_t.append(dt)
        on_c.append(cpu)
        agree.append(sum(x == y for p, q in zip(off_tok, on_tok) for x, y in zip(p, q)) /
                     sum(lens))
        print(f"  repeat {r}: LLM.generate {off_t[-1]:.2f}s ({off_c[-1]:.2f} CPU s)  AsyncLLM "
              f"{on_t[-1]:.2f}s ({on_c[-1]:.2f} CPU s)", flush=True)
    cpu = idle_cpu(on_pids)
    online.shutdown()
    llm.close()
    tokens, rows = sum(lens), {}
    for name, ts, cs in ((OFFLINE, off_t, off_c), (ONLINE, on_t, on_c)):
        med = statistics.median(ts)
        rows[name] = dict(seconds_median=med, seconds_min=min(ts), seconds=ts,
                          cpu_seconds_median=statistics.median(cs), cpu_seconds=cs,
                          output_tokens_per_s=tokens / med,
                          output_tokens_per_s_best=tokens / min(ts))
    off, on = rows[OFFLINE], rows[ONLINE]
    return dict(results=rows,
                throughput_ratio=on["output_tokens_per_s"] / off["output_tokens_per_s"],
                throughput_ratio_best=on["output_tokens_per_s_best"] /
                off["output_tokens_per_s_best"],
                throughput_ratio_pairs=statistics.median(o / n for o, n in zip(off_t, on_t)),
                cpu_seconds_ratio=on["cpu_seconds_median"] / off["cpu_seconds_median"],
                streamed_outputs=yields, token_agreement=min(agree), idle_cpu_fraction=cpu)


if __name__ == "__main__":
    main()
