"""Single mode end to end: ``megainfer.LLM.generate`` vs Hugging Face ``generate``, same device.

    python perf/bench/bench_gpu_engine.py [--device cuda] [--batches 1,64,256] [--out FILE]
    python perf/bench/bench_gpu_engine.py --device cpu --tiny      # smoke test: tiny shapes, seconds

Models: Mixtral-8x7B and Qwen3-30B-A3B shapes (conf/model/*.yaml) cut to --layers (8), random
weights drawn on the device; bf16 on cuda, fp32 on cpu. Prompts: random token ids (seeded),
--input-len (256) each; --output-len (256) tokens out, greedy, eos ignored. Systems:
``megainfer`` (CUDA graphs for decode), ``megainfer-eager`` (no graphs) and ``hf``
(``AutoModelForCausalLM.from_config``; skipped with the reason when transformers is missing).
Each (model, system, batch) is warmed up once (Triton compiles and graph capture happen
there), then timed twice: with 1 output token (prefill + first token) and with --output-len.
  decode_step_s = (t(output_len) - t(1)) / (output_len - 1): one decode step of the batch.
HF runs its default experts implementation (grouped_mm where torch has it) in decode too:
transformers 5.x's ``generate`` otherwise switches decode to ``batched_mm``, which copies one
expert's weights per (token, expert) pair (180 GB for Mixtral at batch 256).

Roofline of a decode step (HBM bytes it must read / measured bandwidth), same for every system:
  bytes: ``megainfer.bench.decode_roofline`` (weights, the experts a batch touches, the KV
          read) at the mean decode context ctx = input_len + output_len / 2.
  bandwidth: a device-to-device ``copy_`` of N bytes (1 GiB on cuda), timed with CUDA events
          (median of 10), counted as 2N / t: bytes read + bytes written. HBM serves reads and
          writes from one budget, so a read-only stream (a decode step) can move about what a
          copy moves in total; counting N / t instead would put the ceiling at half what the
          memory delivers. Both figures are in the JSON (copy.bw_rw, copy.bw_n_over_t).
  roofline_frac = roofline_step_s / decode_step_s (1.0: the step runs at the copy bandwidth).
Rows are written to perf/results/bench_gpu_engine_<device>.json as each one finishes.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from megainfer import LLM, SamplingParams
from megainfer.config import ModelConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402

from megainfer.bench.results_io import write_json  # noqa: E402

from megainfer.bench.decode_roofline import MODELS, decode_roofline, model_config  # noqa: E402

FULL_RUN = dict(layers=8, batches="1,64,256", input_len=256, output_len=256)
TINY_RUN = dict(layers=2, batches="1,4", input_len=16, output_len=8)
def copy_bandwidth(dev: str) -> dict:
    """A device-to-device copy of N bytes, median of 10 after 3 warm-ups (module docstring)."""
    n = 2 ** 30 if dev == "cuda" else 32 * 2 ** 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    dst, samples = torch.empty_like(src), []
    for i in range(13):
        if dev == "cuda":
            t0, t1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            t0.record()
            dst.copy_(src)
            t1.record()
            t1.synchronize()
            samples.append(t0.elapsed_time(t1) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            samples.append(time.perf_counter() - t)
    t = statistics.median(samples[3:])
    return dict(nbytes=n, median_s=t, bw_rw=2 * n / t, bw_n_over_t=n / t,
                convention="roofline uses bw_rw = 2N/t (bytes read + written by a copy of N "
                           "bytes); bw_n_over_t = N/t is given for reference")


def build_hf(cfg: ModelConfig, dtype, dev: str):
    import transformers
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  num_experts_per_tok=cfg.top_k, max_position_embeddings=cfg.max_position_embeddings,
                  rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
                  bos_token_id=cfg.bos_token_id, eos_token_id=2, pad_token_id=0)
    if cfg.family == "mixtral":
        hcfg = transformers.MixtralConfig(**common, num_local_experts=cfg.num_experts,
                                          intermediate_size=cfg.moe_intermediate_size)
    else:
        hcfg = transformers.Qwen3MoeConfig(**common, num_experts=cfg.num_experts,
                                           moe_intermediate_size=cfg.moe_intermediate_size,
                                           intermediate_size=cfg.intermediate_size or 1,
                                           norm_topk_prob=cfg.norm_topk_prob, mlp_only_layers=[],
                                           decoder_sparse_step=1)
    torch.manual_seed(0)
    with torch.device(dev):
        hf = transformers.AutoModelForCausalLM.from_config(hcfg, dtype=dtype).eval()
    hf._optimize_model_for_decode = contextlib.nullcontext  # keep grouped_mm (docstring)
    return hf


def hf_runner(hf):
    gc_ = copy.deepcopy(hf.generation_config)  # eos off like ignore_eos: an id past the vocab
    gc_.eos_token_id, gc_.pad_token_id, gc_.do_sample = 10 ** 6, 0, False

    def run(prompts: torch.Tensor, n: int):
        gc_.max_new_tokens = n
        with torch.no_grad():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=gc_)
        assert out.shape == (prompts.shape[0], prompts.shape[1] + n), out.shape
    return run


def mega_runner(llm):
    def run(prompts: torch.Tensor, n: int) -> int:
        steps = llm.engine.num_steps
        try:
            outs = llm.generate(prompts.tolist(), SamplingParams(temperature=0.0, max_tokens=n,
                                                                 ignore_eos=True), use_tqdm=False)
        except BaseException:  # an OOM mid-run: drop its requests so the next batch runs alone
            for rid in list(llm.engine.requests):
                llm.engine.abort_request(rid)
            raise
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return llm.engine.num_steps - steps
    return run


def measure(run, prompts, out_len, repeats, sync) -> dict:
    def timed(n):
        ts, steps = [], 0
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            steps = run(prompts, n)
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts), steps
    run(prompts, min(3, out_len))  # warm-up: compiles, graph capture, allocator
    t1, _ = timed(1)
    tn, steps = timed(out_len)
    b = prompts.shape[0]
    return dict(prefill_s=t1, total_s=tn, decode_step_s=(tn - t1) / max(1, out_len - 1),
                output_tok_s=b * out_len / tn, engine_steps=steps or None)


class Skip(Exception):
    """A config not run on purpose (time budget, transformers missing): recorded as skipped."""


def free(sync):
    gc.collect()
    sync()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build(system: str, cfg: ModelConfig, a) -> tuple:
    """(run function, what the row records about the system)."""
    if system == "hf":
        hf = build_hf(cfg, a.torch_dtype, a.device)
        impl = getattr(hf, "get_experts_implementation", lambda: None)()
        return hf_runner(hf), dict(experts_implementation=str(impl),
                                   attn_implementation=getattr(hf.config, "_attn_implementation", None))
    B, P, O = max(a.batches), a.input_len, a.output_len
    llm = LLM(cfg, dtype=a.dtype, device=a.device, cuda_graphs=system == "megainfer",
              max_num_seqs=B, max_num_batched_tokens=B * P, max_model_len=P + O,
              num_blocks=B * -(-(P + O) // 16) + 1, seed=0)
    dc = llm.device_config
    return mega_runner(llm), dict(cuda_graphs=dc.cuda_graphs, attention_backend=dc.attention_backend)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: 2 layers, batch 1 and 4, "
                    "16 in / 8 out (smoke test)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--systems", default="megainfer,megainfer-eager,hf")
    for opt in ("--layers", "--input-len", "--output-len"):
        ap.add_argument(opt, type=int)
    ap.add_argument("--batches")
    ap.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=0, help="skip what is left once this many "
                    "seconds have passed (0: no limit)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on cpu")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    t_start, tiny, dev = time.monotonic(), a.tiny, a.device
    for k, v in (TINY_RUN if tiny else FULL_RUN).items():
        setattr(a, k, getattr(a, k) or v)
    a.batches = [int(b) for b in str(a.batches).split(",")]
    P, O = a.input_len, a.output_len
    a.dtype = a.dtype or ("bfloat16" if dev == "cuda" else "float32")
    a.torch_dtype = getattr(torch, a.dtype)
    if dev == "cpu":
        torch.set_num_threads(a.threads)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out = Path(a.out or Path(RESULTS) / f"bench_gpu_engine_{dev}{'_tiny' if tiny else ''}.json")
    bw = copy_bandwidth(dev)
    try:
        import transformers
        hf_version, hf_missing = transformers.__version__, None
    except ImportError as e:
        hf_version, hf_missing = None, f"transformers not importable: {e}"
    res = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), argv=sys.argv[1:],
               machine=dict(platform=platform.platform(), torch=torch.__version__,
                            transformers=hf_version,
                            gpu=torch.cuda.get_device_name() if dev == "cuda" else None),
               device=dev, dtype=a.dtype, input_len=P, output_len=O, copy=bw, models={},
               rows=[], ratios=[])
    print(f"[bench] {dev} {a.dtype}: copy {bw['bw_rw'] / 1e9:.0f} GB/s (read + write)", flush=True)

    def over_budget():
        return a.budget_s and time.monotonic() - t_start > a.budget_s

    def add(row):
        res["rows"].append(row)
        res["ratios"] = ratios(res["rows"])
        write_json(out, res, quiet=True)  # after every row: a crash keeps what finished
    cfgs = {name: model_config(name, a.layers, tiny) for name in a.models.split(",")}
    res["models"] = {name: dataclasses.asdict(cfg) for name, cfg in cfgs.items()}
    # systems outermost: a budget cut loses the last system (HF by default) on every model,
    # not every system on the last model
    for system, (name, cfg) in ((s, m) for s in a.systems.split(",") for m in cfgs.items()):
        base, run = dict(model=name, system=system), None
        try:
            if system == "hf" and hf_missing:
                raise Skip(hf_missing)
            if over_budget():
                raise Skip("time budget spent")
            t = time.perf_counter()
            run, info = build(system, cfg, a)
            sync()
            base.update(info, build_s=time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - recorded; the other systems still run
            why = str(e) if isinstance(e, Skip) else f"{type(e).__name__}: {e}"[:300]
            for b in a.batches:
                add(dict(base, batch=b, **{"skipped" if isinstance(e, Skip) else "error": why}))
            free(sync)
            continue
        for b in a.batches:
            row = dict(base, batch=b)
            prompts = torch.randint(3, cfg.vocab_size, (b, P),
                                    generator=torch.Generator().manual_seed(1000 + b))
            try:
                if over_budget():
                    raise Skip("time budget spent")
                row.update(measure(run, prompts.to(dev) if system == "hf" else prompts,
                                   O, a.repeats, sync))
                roof = row["roofline"] = decode_roofline(cfg, b, P + O / 2, a.torch_dtype.itemsize)
                roof["roofline_step_s"] = roof["bytes_per_step"] / bw["bw_rw"]
                roof["roofline_frac"] = roof["roofline_step_s"] / row["decode_step_s"]
                print(f"[bench] {name} {system} b={b}: total {row['total_s']:.2f} s, "
                      f"{row['output_tok_s']:.0f} tok/s, decode {1e3 * row['decode_step_s']:.2f}"
                      f" ms/step ({100 * roof['roofline_frac']:.0f}% of roofline)", flush=True)
            except Exception as e:  # noqa: BLE001 - an OOM at one batch keeps the rest
                key = "skipped" if isinstance(e, Skip) else "error"
                row[key] = str(e) if isinstance(e, Skip) else f"{type(e).__name__}: {e}"[:300]
                print(f"[bench] {name} {system} b={b}: {row[key]}", flush=True)
            add(row)
            free(sync)
        del run
        free(sync)
    print_table(res)
    print(f"[bench] wrote {out} ({time.monotonic() - t_start:.0f} s)")
    return res


def ratios(rows) -> list[dict]:
    """megainfer / HF per (model, batch): throughput ratio and decode speedup (>1: faster)."""
    ok = {(r["model"], r["batch"], r["system"]): r for r in rows if "total_s" in r}
    out = []
    for (m, b, s), r in ok.items():
        hf = ok.get((m, b, "hf"))
        if s != "hf" and hf:
            out.append(dict(model=m, batch=b, system=s,
                            tok_s_vs_hf=r["output_tok_s"] / hf["output_tok_s"],
                            decode_speedup_vs_hf=hf["decode_step_s"] / r["decode_step_s"]))
    return out


def print_table(res):
    rat = {(r["model"], r["batch"], r["system"]): r for r in res["ratios"]}
    print(f"{'model':<15}{'b':>5} {'system':<16}{'total s':>9}{'tok/s':>10}{'ms/step':>9}"
          f"{'roof ms':>9}{'%roof':>7}{'x HF tok/s':>11}{'x HF dec':>9}")
    for r in res["rows"]:
        head = f"{r['model']:<15}{r['batch']:>5} {r['system']:<16}"
        if "total_s" not in r:
            print(head + (r.get("error") or r.get("skipped", ""))[:80])
            continue
        q, x = r["roofline"], rat.get((r["model"], r["batch"], r["system"]))
        xs = f"{x['tok_s_vs_hf']:>11.2f}{x['decode_speedup_vs_hf']:>9.2f}" if x else ""
        print(head + f"{r['total_s']:>9.2f}{r['output_tok_s']:>10.0f}"
              f"{1e3 * r['decode_step_s']:>9.2f}{1e3 * q['roofline_step_s']:>9.2f}"
              f"{100 * q['roofline_frac']:>7.0f}" + xs)


if __name__ == "__main__":
    main()
