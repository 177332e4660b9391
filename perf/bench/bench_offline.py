"""Offline throughput: ``megainfer.LLM.generate`` vs Hugging Face ``generate``, side by side.

    python perf/bench/bench_offline.py [--batch 32 --input-len 64 --output-len 64 --repeats 3]
        [--formats fp32 bf16 int8+bf16 int4+bf16 fp8 --out FILE]

``--formats`` (issue 50's jobs per weight format): one ``LLM`` per format of the same checkpoint
(``fp32``; ``bf16``: ``dtype=bfloat16``; ``int8`` / ``int4`` (group ``--group-size``) / ``fp8``:
``quantization=``, with ``+bf16`` for bfloat16 activations), each timed beside transformers'
fp32 in the same alternation, its greedy tokens compared with transformers' (a quantised
format's agree only as far as its rounding lets them).

Same checkpoint (a ~49M-parameter Mixtral-shaped model, random weights, saved with
``save_pretrained``), same prompts (random token ids, all the same length so HF needs no
padding), greedy, eos ignored. Each side runs ``--repeats`` times, alternating; the table shows
medians. Also measured in the same run: this machine's fp32 matmul rate (the roofline), and
the fraction of it each side reaches, counting 2 x active parameters FLOPs per token processed
(prompt + generated) plus attention. Writes ``perf/results/bench_offline.json``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from megainfer.calibration.layer_bench import time_fn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402


def build_checkpoint(path: str, a) -> None:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, num_local_experts=a.experts,
        num_experts_per_tok=a.top_k, intermediate_size=a.inter, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    transformers.MixtralForCausalLM(cfg).float().eval().save_pretrained(path)


def active_flops_per_token(a, ctx: float) -> float:
    """2 x (parameters a token touches) + attention (QK^T and PV over ``ctx`` keys)."""
    D = a.hidden // a.heads
    attn = a.hidden * D * (2 * a.heads + 2 * a.kv_heads)
    experts = a.top_k * 3 * a.hidden * a.inter
    router = a.hidden * a.experts
    per_layer = 2 * (attn + experts + router) + 4 * a.heads * D * ctx
    return a.layers * per_layer + 2 * a.hidden * a.vocab  # + lm_head


def job_flops(a) -> float:
    """Every prompt token once (prefill, mean context L/2), every generated token once."""
    P, O = a.input_len, a.output_len
    prefill = P * active_flops_per_token(a, P / 2)
    decode = O * active_flops_per_token(a, P + O / 2)
    return a.batch * (prefill + decode)


def matmul_roofline(n: int = 1024, reps: int = 10) -> float:
    """Median fp32 GFLOP/s of an n x n x n matmul on this process's threads."""
    x, y = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / time_fn(lambda: x @ y, repeats=reps, warmup=3) / 1e9


def read_bandwidth(n: int = 64 * 2**20, reps: int = 10) -> float:
    """Median bytes/s of summing a 256 MB fp32 tensor (a pure read stream) on this process's threads."""
    x = torch.ones(n)
    return 4 * n / time_fn(x.sum, repeats=reps, warmup=1)


def time_lower_bound(a, n_params: int, peak_flops: float, read_bps: float) -> dict:
    """Fastest this job can run here: prefill at the fp32 matmul roofline; each decode step must
    read every weight but the embedding once (with batch x top_k >> experts every expert is hit)
    plus the KV cache, at the measured read bandwidth, and do its FLOPs (whichever is slower)."""
    P, O = a.input_len, a.output_len
    prefill = a.batch * P * active_flops_per_token(a, P / 2) / peak_flops
    weight_bytes = 4 * (n_params - a.vocab * a.hidden)
    kv_bytes = 4 * 2 * a.layers * a.kv_heads * (a.hidden // a.heads) * a.batch * (P + O / 2)
    step_read = (weight_bytes + kv_bytes) / read_bps
    step_flops = a.batch * active_flops_per_token(a, P + O / 2) / peak_flops
    decode = (O - 1) * max(step_read, step_flops)
    return dict(seconds=prefill + decode, prefill_s=prefill, decode_step_s=max(step_read, step_flops),
                weight_bytes_per_step=weight_bytes, kv_bytes_per_step=kv_bytes)


def run_hf(hf, prompts, n_out):
    """HF ``generate`` of every prompt in one batch; ``n_out``: new tokens, one count for all or
    one per prompt (prompts of mixed lengths are left-padded with token 0 and masked, and every
    row runs to the longest output, as one HF call does) -> (seconds, tokens per prompt)."""
    import copy
    outs = n_out if isinstance(n_out, (list, tuple)) else [n_out] * len(prompts)
    L = max(len(p) for p in prompts)
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample, gc.max_new_tokens = 10**6, 0, False, max(outs)
    ids = torch.tensor([[0] * (L - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, generation_config=gc)
    dt = time.perf_counter() - t
    return dt, [row[L:L + n] for row, n in zip(out.tolist(), outs)]


def run_ours(llm, prompts, n_out):
    """``LLM.generate``, greedy, eos ignored; ``n_out`` as in ``run_hf``."""
    from megainfer import SamplingParams
    outs = n_out if isinstance(n_out, (list, tuple)) else [n_out] * len(prompts)
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    t = time.perf_counter()
    res = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, [o.outputs[0].token_ids for o in res]


def format_args(fmt: str, group: int) -> dict:
    """``LLM`` keyword arguments of a ``--formats`` entry: ``fp32`` | ``bf16`` | ``Q[+bf16]``
    (Q: int8, int4, fp8)."""
    q, _, act = fmt.partition("+")
    if act not in ("", "bf16") or q not in ("fp32", "bf16", "int8", "int4", "fp8"):
        raise SystemExit(f"--formats {fmt!r}: fp32, bf16, or int8 / int4 / fp8 with an optional +bf16")
    dtype = "bfloat16" if "bf16" in (q, act) else "float32"
    quant = None if q in ("fp32", "bf16") else q
    over = [f"model.quantization_group_size={group}"] if quant == "int4" else []
    return dict(dtype=dtype, quantization=quant, overrides=over)


def agreement(a_tokens, b_tokens) -> float:
    """Fraction of positions where two runs' greedy tokens agree."""
    same = sum(x == y for a, b in zip(a_tokens, b_tokens) for x, y in zip(a, b))
    return same / max(1, sum(len(a) for a in a_tokens))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--formats", nargs="+", default=["fp32"],
                    help="weight formats, one LLM each: fp32 bf16 int8 int4 fp8, +bf16 for "
                         "bfloat16 activations (the first is the headline row)")
    ap.add_argument("--group-size", type=int, default=64, help="int4's group size")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_offline.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import transformers
    from megainfer import LLM

    with tempfile.TemporaryDirectory() as d:
        build_checkpoint(d, a)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
        n_params = sum(p.numel() for p in hf.parameters())
        llms = {f: LLM(d, max_num_seqs=a.batch, max_num_batched_tokens=max(2048, a.batch * a.input_len),
                       max_model_len=a.input_len + a.output_len, block_size=16,
                       **format_args(f, a.group_size)) for f in a.formats}
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, a.vocab, (a.batch, a.input_len), generator=g).tolist()
        for llm in llms.values():  # warm-up every side
            run_ours(llm, prompts[:2], 4)
        run_hf(hf, prompts[:2], 4)
        roof, bw = [matmul_roofline()], [read_bandwidth()]
        hf_t, our_t, agrees = [], {f: [] for f in a.formats}, {}
        for r in range(a.repeats):
            dt, hf_tok = run_hf(hf, prompts, a.output_len)
            hf_t.append(dt)
            for f in (a.formats if r % 2 == 0 else a.formats[::-1]):  # alternating order
                dt, our_tok = run_ours(llms[f], prompts, a.output_len)
                our_t[f].append(dt)
                agrees[f] = agreement(hf_tok, our_tok)
            print(f"  repeat {r}: hf {hf_t[-1]:.2f}s  " + "  ".join(
                f"{f} {our_t[f][-1]:.2f}s" for f in a.formats), flush=True)
        roof.append(matmul_roofline())
        bw.append(read_bandwidth())
    tokens = a.batch * a.output_len
    flops = job_flops(a)
    peak = statistics.median(roof)
    rows = {}
    ours_name = lambda f: "megainfer LLM.generate" + ("" if f == "fp32" else f" [{f}]")  # noqa: E731
    agree = agrees.get("fp32", next(iter(agrees.values())))
    for name, ts in (("transformers generate", hf_t),
                     *((ours_name(f), our_t[f]) for f in a.formats)):
        med, best = statistics.median(ts), min(ts)
        rows[name] = dict(seconds_median=med, seconds_min=best, seconds=ts,
                          output_tokens_per_s=tokens / med, output_tokens_per_s_best=tokens / best,
                          gflops=flops / med / 1e9, roofline_fraction=flops / med / 1e9 / peak,
                          roofline_fraction_best=flops / best / 1e9 / peak)
    for f in a.formats:
        rows[ours_name(f)]["greedy_token_agreement_with_transformers_fp32"] = agrees[f]
        rows[ours_name(f)]["vs_transformers_fp32"] = (
            rows[ours_name(f)]["output_tokens_per_s"] / rows["transformers generate"]["output_tokens_per_s"])
    ours, base = rows[ours_name(a.formats[0])], rows["transformers generate"]
    speedup = ours["output_tokens_per_s"] / base["output_tokens_per_s"]
    speedup_best = ours["output_tokens_per_s_best"] / base["output_tokens_per_s_best"]
    bound = time_lower_bound(a, n_params, peak * 1e9, statistics.median(bw))
    bound["max_speedup_over_transformers"] = base["seconds_min"] / bound["seconds"]
    load = os.getloadavg()
    print(f"\nbatch {a.batch}, {a.input_len} in / {a.output_len} out, {n_params / 1e6:.1f}M params "
          f"({a.experts} experts top-{a.top_k}), {a.threads} threads, fp32 roofline "
          f"{peak:.1f} GFLOP/s, load average {load[0]:.1f}")
    w = max(24, max(len(n) for n in rows) + 2)
    print(f"{'':<{w}}{'median s':>10}{'min s':>8}{'out tok/s':>12}{'GFLOP/s':>10}"
          f"{'of roofline':>13}{'(best run)':>12}{'vs HF fp32':>12}{'greedy = HF':>13}")
    for name, r in rows.items():
        extra = (f"{r['vs_transformers_fp32']:>11.2f}x"
                 f"{100 * r['greedy_token_agreement_with_transformers_fp32']:>12.1f}%"
                 if "vs_transformers_fp32" in r else "")
        print(f"{name:<{w}}{r['seconds_median']:>10.2f}{r['seconds_min']:>8.2f}"
              f"{r['output_tokens_per_s']:>12.1f}{r['gflops']:>10.2f}"
              f"{100 * r['roofline_fraction']:>12.1f}%{100 * r['roofline_fraction_best']:>11.1f}%"
              + extra)
    print(f"speedup over transformers: {speedup:.2f}x on medians, {speedup_best:.2f}x on best runs "
          f"(target >= 4x); greedy tokens equal to transformers': {100 * agree:.1f}%")
    print(f"lower bound on this job's time here (prefill at the matmul roofline, each decode step "
          f"reading {bound['weight_bytes_per_step'] / 1e6:.0f} MB of weights + KV at the measured "
          f"{statistics.median(bw) / 1e9:.1f} GB/s read bandwidth): {bound['seconds']:.2f} s, so no "
          f"engine can beat transformers' best run by more than "
          f"{bound['max_speedup_over_transformers']:.2f}x at this shape")
    print("note: on a shared machine, medians swing with other load; best runs are the steadier "
          "ratio")
    result = dict(
        name="bench_offline", date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), processor=platform.processor(),
                     cpu_count=os.cpu_count(), python=sys.version.split()[0],
                     torch=torch.__version__, load_average=load),
        args=vars(a), params=n_params, output_tokens=tokens, job_flops=flops,
        roofline_gflops=peak, roofline_samples=roof, read_bandwidth_Bps=bw, lower_bound=bound,
        results=rows, speedup=speedup,
        speedup_best=speedup_best,
        greedy_token_agreement=agree, baseline="transformers generate (same checkpoint, prompts)")
    write_json(a.out, result, indent=2)


if __name__ == "__main__":
    main()
