"""One CPU decode step against its physical floor, before and after issue 38, beside HF's step;
then the engine-vs-HF job race (perf/bench/bench_offline.py) with prefix caching off.

    python perf/bench/bench_decode_step.py [--batches 1 8 32 64 --threads 1 2 --context 100
                                      --repeats 15 --consecutive 4 --no-jobs --no-contention]

Model: the 54.5M Mixtral-shaped checkpoint of issue 38 (vocab 1024, hidden 512, inter 1024,
4 layers, 8/4 heads, 8 experts top-2; random weights, saved by bench_offline.build_checkpoint),
fp32. A step: B sequences with ``--context`` cached tokens each and one new token, through
``AttentionMetadata.build_with`` + ``MoECausalLM.forward`` + ``compute_logits`` (what
``LocalExecutor.execute`` runs; the engine's scheduler and sampler are not in it).

* after:  the measured GEMM and expert-path rules (``kernels/cpu_gemm_rules.json``,
  ``kernels/cpu_moe_rules.json``), as shipped.
* per_expert: after with the expert path forced to one GEMM pair per expert
  (``cpu_moe_rules.forced("per_expert")``): the baseline of the grouped ``torch._grouped_mm``
  path where the rule picks it (``after / per_expert`` is what that rule buys in a step).
* before: ``cpu_gemm.use_rules(OLD_RULES)``, per-expert: MKL everywhere, experts weight-major
  for 3-16 rows (the GEMMs before issue 38; the attention and host-op changes have no switch,
  so "before" is an upper bound on what the GEMMs alone bought).
* HF:     ``MixtralForCausalLM`` forward of one token per sequence over a ``DynamicCache`` of
  the same context (cropped back after each step).
* floor:  max(bytes / read bandwidth, FLOPs / matmul rate), both measured in this run by
  bench_offline's probes, three times before and once after each thread count's steps, the
  best of them used; "trusted" when the slowest probe is within 15% of the best and the load
  average left this process its cores (``floor_trust``): bytes = every weight the step reads (the experts the batch can hit:
  min(E, B * top_k) per layer; all but the embedding) + the KV cache; FLOPs = 2 x active
  parameters per token + attention.

Rounds alternate after, before, HF, each running ``--consecutive`` steps back to back (as the
engine's decode steps run); the figure is the median of every block's steps after its first
(``median_s``), each block's first step, which follows the other model's, is kept beside it
(``cold_median_s``: the figure of ``--consecutive 1``). Mixed contexts: a
step at B = 32 and 64 over contexts of 16-320 tokens, length-grouped decode attention against
one batch padded to the longest (``decode_attention.MAX_GROUPS = 1``), alternating. Contention
(``--no-contention`` skips it): the step at B = 1 and 8 at each thread count, alone and beside
one busy-looping process. Jobs (``--no-jobs`` skips
them): bench_offline's race at each thread count, equal lengths (B=32, 64 in / 64 out),
mixed lengths (64 requests, prompts 16-192, outputs 16-128) and prefill (the equal-length prompts,
one token out: the prefill and one sampled token), prefix caching off. Writes
``perf/results/bench_decode_step.json`` with the machine and the load average.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
import bench_offline  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402
from perf_paths import RESULTS  # noqa: E402
from decode_steps import HFStep, MixedStep, OursStep, step_floor, time_once  # noqa: E402
from tune_cpu_gemm import cores_were_free  # noqa: E402

SHAPE = dict(vocab=1024, hidden=512, layers=4, heads=8, kv_heads=4, experts=8, top_k=2,
             inter=1024)


def probe_machine(n: int = 3) -> list[tuple[float, float]]:
    """n x (matmul FLOP/s, read bytes/s) on this process's threads (bench_offline's probes)."""
    return [(bench_offline.matmul_roofline() * 1e9, bench_offline.read_bandwidth())
            for _ in range(n)]


def floor_trust(probes: list[tuple[float, float]], threads: int, load_at_start: float) -> dict:
    """The floor uses the best rate the probes saw (what the machine can do when this process
    has its cores: the lowest, most demanding floor); it is trusted when the slowest probe is
    within 15% of the best, before and after the steps, and the load average left the cores
    free (``tune_cpu_gemm.cores_were_free``: other jobs on the cores make every probe slow and
    the floor too lenient)."""
    rates, bws = [p[0] for p in probes], [p[1] for p in probes]
    spread = min(min(rates) / max(rates), min(bws) / max(bws))
    return dict(rate=max(rates), bw=max(bws), probe_spread=spread,
                load_average=[load_at_start, os.getloadavg()[0]],
                trusted=spread >= 0.85 and cores_were_free(threads, load_at_start),
                probes=probes)


def variant(name: str, previous=None):
    """The rules a step variant runs under (``after``: as shipped; ``previous``: the GEMM rule
    table of ``--previous-rules``, the expert path as shipped)."""
    from megainfer.kernels import cpu_gemm, cpu_moe_rules
    if name == "after":
        return contextlib.nullcontext()
    if name == "previous":
        return cpu_gemm.use_rules(previous)
    stack = contextlib.ExitStack()
    stack.enter_context(cpu_moe_rules.use_rules(cpu_moe_rules.forced("per_expert")))
    if name == "before":
        stack.enter_context(cpu_gemm.use_rules(cpu_gemm.OLD_RULES))
    return stack


def bench_steps(a, shape, model, hf, n_params: int) -> list[dict]:
    rows, names = [], ("after", "per_expert", "before", "hf") + (("previous",) if a.previous else ())
    for t in a.threads:
        torch.set_num_threads(t)
        load_at_start, probes, block = os.getloadavg()[0], probe_machine(), []
        for B in a.batches:
            ours, theirs = OursStep(model, B, a.context), HFStep(hf, B, a.context)
            for _ in range(3):  # warm-up: first-touch packs and scratch buffers
                for name in names:
                    with variant(name, a.previous):
                        theirs() if name == "hf" else ours()
            s, cold = {n: [] for n in names}, {n: [] for n in names}  # cold: each block's 1st
            for _ in range(a.repeats):
                for name in names:
                    with variant(name, a.previous):
                        fn = theirs if name == "hf" else ours
                        ts = [time_once(fn) for _ in range(a.consecutive)]
                    cold[name].append(ts[0])
                    s[name].extend(ts[1:] or ts)
            med = {k: statistics.median(v) for k, v in s.items()}
            block.append(dict(threads=t, batch=B, context=a.context, median_s=med, samples_s=s,
                              cold_median_s={k: statistics.median(v) for k, v in cold.items()},
                              cold_samples_s=cold, load_average=os.getloadavg()))
        trust = floor_trust(probes + probe_machine(), t, load_at_start)  # before and after
        for r in block:
            B, med = r["batch"], r["median_s"]
            floor = step_floor(shape, B, a.context, n_params, trust["bw"], trust["rate"])
            r.update(floor=floor, read_Bps=trust["bw"], matmul_flops=trust["rate"],
                     floor_trust=trust)
            rows.append(r)
            c = r["cold_median_s"]
            print(f"{t:>3} {B:>4} {floor['seconds'] * 1e3:8.2f} {med['after'] * 1e3:8.2f} "
                  f"{med['per_expert'] * 1e3:8.2f} {med['per_expert'] / med['after']:7.2f}x "
                  f"{med['before'] * 1e3:8.2f} {med['hf'] * 1e3:8.2f} "
                  f"{med['after'] / floor['seconds']:8.2f}x {med['before'] / floor['seconds']:7.2f}x "
                  f"{med['hf'] / med['after']:7.2f}x {c['after'] / floor['seconds']:8.2f}x "
                  f"{c['hf'] / c['after']:7.2f}x {r['load_average'][0]:5.1f} "
                  f"{'yes' if trust['trusted'] else 'no':>5}"
                  + (f"  previous {med['previous'] * 1e3:.2f} ms ({med['previous'] / med['after']:.2f}x)"
                     if a.previous else ""), flush=True)
        print(f"    {t} thread(s): {trust['rate'] / 1e9:.0f} GFLOP/s, {trust['bw'] / 1e9:.1f} GB/s, "
              f"slowest probe {100 * trust['probe_spread']:.0f}% of the best", flush=True)
    return rows


def bench_mixed_steps(a, model) -> list[dict]:
    """A decode step over mixed contexts (16 to 320 tokens, what the mixed job's steps hold):
    length groups (``decode_attention``, as shipped) against one batch padded to the longest
    context (``MAX_GROUPS = 1``, the attention before), alternating rounds, same caches."""
    from megainfer.models import decode_attention
    rows, shipped = [], decode_attention.MAX_GROUPS
    for t in a.threads:
        torch.set_num_threads(t)
        for B in (32, 64):
            step, s = MixedStep(model, B, 16, 320), dict(grouped=[], padded=[])
            try:
                for _ in range(a.repeats + 3):
                    for name, groups in (("grouped", shipped), ("padded", 1)):
                        decode_attention.MAX_GROUPS = groups
                        s[name].append(time_once(step))
            finally:
                decode_attention.MAX_GROUPS = shipped
            med = {k: statistics.median(v[3:]) for k, v in s.items()}  # 3 warm-up rounds
            rows.append(dict(threads=t, batch=B, contexts=[16, 320], median_s=med,
                             samples_s=s, load_average=os.getloadavg()))
            print(f"{t:>3} {B:>4} {med['grouped'] * 1e3:8.2f} {med['padded'] * 1e3:8.2f} "
                  f"{med['padded'] / med['grouped']:7.2f}x {rows[-1]['load_average'][0]:5.1f}",
                  flush=True)
    return rows


def bench_contention(a, model) -> list[dict]:
    """The step at each thread count alone and beside one busy-looping process (what another
    job on a 2-core machine is): with as many threads as cores, each parallel region waits for
    the thread the scheduler took away, so 2 threads lose more than 1 does."""
    import subprocess
    rows = []
    for busy in (0, 1):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(busy)]
        try:
            time.sleep(0.5 if busy else 0)
            for t in a.threads:
                torch.set_num_threads(t)
                for B in (1, 8):
                    ours = OursStep(model, B, a.context)
                    for _ in range(3):
                        ours()
                    ts = [time_once(ours) for _ in range(a.repeats)]
                    rows.append(dict(threads=t, batch=B, busy_processes=busy,
                                     median_s=statistics.median(ts), samples_s=ts,
                                     load_average=os.getloadavg()))
                    print(f"{t:>3} {B:>4} {busy:>5} {rows[-1]['median_s'] * 1e3:8.2f} "
                          f"{rows[-1]['load_average'][0]:5.1f}", flush=True)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    return rows


def mixed_workload(n: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 193, (n,), generator=g).tolist()
    outs = torch.randint(16, 129, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens], outs


def bench_jobs(a, path: str, progress) -> list[dict]:
    from megainfer import LLM
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    rows = []
    g = torch.Generator().manual_seed(0)
    equal = (torch.randint(3, a.vocab, (32, 64), generator=g).tolist(), [64] * 32)
    for t in a.threads:
        torch.set_num_threads(t)
        for name, (prompts, outs) in (("equal", equal), ("mixed", mixed_workload(64, a.vocab)),
                                      ("prefill", (equal[0], [1] * 32))):
            longest = max(len(p) for p in prompts) + max(outs)
            llm = LLM(path, max_num_seqs=64, max_num_batched_tokens=2048,
                      max_model_len=longest, block_size=16, enable_prefix_caching=False)
            bench_offline.run_ours(llm, prompts[:2], outs[:2])  # warm-up both sides
            bench_offline.run_hf(hf, prompts[:2], outs[:2])
            hf_t, our_t, agree = [], [], []
            for _ in range(a.job_repeats):
                dt, hf_tok = bench_offline.run_hf(hf, prompts, outs)
                hf_t.append(dt)
                dt, our_tok = bench_offline.run_ours(llm, prompts, outs)
                our_t.append(dt)
                agree.append(bench_offline.agreement(hf_tok, our_tok))
            r = dict(threads=t, workload=name, requests=len(prompts),
                     output_tokens=sum(outs), hf_s=hf_t, ours_s=our_t,
                     speedup=statistics.median(hf_t) / statistics.median(our_t),
                     greedy_agreement=agree[-1], load_average=os.getloadavg())
            rows.append(r)
            progress(rows)
            print(f"{t:>3} {name:<6} {statistics.median(hf_t):8.2f} {statistics.median(our_t):8.2f} "
                  f"{r['speedup']:7.2f}x {100 * r['greedy_agreement']:6.1f}% "
                  f"{r['load_average'][0]:5.1f}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--consecutive", type=int, default=4,
                    help="steps back to back per variant and round, as the engine runs them")
    ap.add_argument("--job-repeats", type=int, default=3)
    ap.add_argument("--no-jobs", dest="jobs", action="store_false")
    ap.add_argument("--no-contention", dest="contention", action="store_false")
    ap.add_argument("--previous-rules", default=None, metavar="JSON",
                    help="a cpu_gemm_rules.json to time beside the shipped one (variant previous)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_decode_step.json"))
    a = ap.parse_args(argv)
    a.previous = None
    if a.previous_rules:  # read now: the run may rewrite the file it names
        import json
        with open(a.previous_rules) as f:
            a.previous = json.load(f)["rules"]
    shape = SimpleNamespace(**SHAPE)
    import transformers

    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.models.loader import build_model
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        bench_offline.build_checkpoint(d, shape)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
        n_params = sum(p.numel() for p in hf.parameters())
        model = build_model(ModelConfig.from_pretrained(d), LoadConfig(path=d))
        print(f"decode step, {n_params / 1e6:.1f}M params, context {a.context}, "
              f"load average {load0[0]:.1f}")
        print(f"{'thr':>3} {'B':>4} {'floor ms':>8} {'after':>8} {'per_exp':>8} {'pe/aft':>8} "
              f"{'before':>8} {'HF':>8} "
              f"{'after/fl':>9} {'bef/fl':>8} {'HF/aft':>8} {'1st/fl':>9} {'HF/aft':>8} "
              f"{'load':>5} {'trust':>5}   (ms: steps 2..k of k back to back; 1st: each "
              "block's first)")
        result = dict(name="bench_decode_step", args=vars(a), shape=SHAPE, params=n_params,
                      steps=[], jobs=[], complete=False,
                      baseline="per_expert: the shipped rules with the expert path forced to "
                               "one GEMM pair per expert; before: cpu_gemm.OLD_RULES, per "
                               "expert; HF: transformers forward / generate; same rounds")
        result["steps"] = bench_steps(a, shape, model, hf, n_params)
        save(a, result, load0)  # written after each part: a run cut short keeps what it measured
        print(f"\nmixed contexts 16-320: length groups vs one padded batch\n{'thr':>3} "
              f"{'B':>4} {'grouped':>8} {'padded':>8} {'gain':>8} {'load':>5}")
        result["mixed_steps"] = bench_mixed_steps(a, model)
        save(a, result, load0)
        if a.contention:
            print(f"\nthe step beside busy processes\n{'thr':>3} {'B':>4} {'busy':>5} "
                  f"{'ms':>8} {'load':>5}")
            result["contention"] = bench_contention(a, model)
            save(a, result, load0)
        if a.jobs:
            a.vocab = shape.vocab
            print(f"\njobs, prefix caching off\n{'thr':>3} {'job':<6} {'HF s':>8} {'ours s':>8} "
                  f"{'speedup':>8} {'greedy':>7} {'load':>5}")
            result["jobs"] = bench_jobs(a, d, lambda rows: save(a, dict(result, jobs=rows), load0))
    result["complete"] = True
    load = save(a, result, load0)
    print(f"load average at start / end: {load0[0]:.1f} / {load[0]:.1f} on {os.cpu_count()} cores "
          "(a shared machine: medians, and ratios from the same rounds)")


def save(a, result: dict, load0) -> tuple:
    load = os.getloadavg()
    write_json(a.out, dict(
        result, date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), processor=platform.processor(),
                     cpu_count=os.cpu_count(), python=sys.version.split()[0],
                     torch=torch.__version__, load_average=[load0, load])), indent=2)
    return load

if __name__ == "__main__":
    main()
