"""Weight formats (``model.quantization``) on CPU: accuracy on the trained tiny model against
the same model in fp32, and the decode step's speed per format against fp32 and its own floor,
in one run.

    python perf/bench/bench_weight_formats.py [--trained-steps 800 --trained-ckpt DIR
                                               --batches 1 8 32 64 --repeats 12 --threads 1 2
                                               --no-accuracy --no-before]

Accuracy (perf/harness/trained_tiny.py's Mixtral, trained on its synthetic language; random
weights cannot answer accuracy): ``--eval-seqs`` held-out sequences of 256 tokens, teacher
forced (one uncached forward per sequence, activations fp32 unless the row says bf16):
perplexity of the next token; greedy agreement = share of positions whose argmax equals the
fp32 model's; mean |delta logprob| of the fp32 argmax token; and free-running greedy decoding of
``--gen-prompts`` prompts x ``--gen-tokens`` tokens through ``LLM`` (position by position
against fp32's tokens: after a first divergence the contexts differ, so it is a lower bound).

Speed: the decode step of perf/bench/decode_steps.py (B rows, ``--context`` cached tokens, one
new token: AttentionMetadata + forward + logits) on the 54.5M Mixtral shape of
bench_decode_step (dummy weights, drawn in fp32 and quantised on load), median of
``--repeats`` steps after 2 warm-ups, the formats interleaved step by step (a busy host slows
them alike), at each of ``--threads``; beside every int8/int4 row a "before" row (the same
model under ``cpu_qgemm_rules.use_rules(WEIGHT_ONLY)``: torch's weight-only kernels at every
row count, the op before the measured rules; ``--no-before`` drops them); floor = bytes the step reads (every weight but
the embedding, in its stored format with its scales, experts scaled to the min(E, B * top_k)
the batch can hit, plus the KV cache) / the read bandwidth measured in this run at that
thread count. Writes ``perf/results/bench_weight_formats.json``; with ``--no-accuracy`` the
accuracy rows (and their date) of the JSON already there are kept.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
import bench_offline  # noqa: E402
from megainfer.kernels import cpu_qgemm_rules  # noqa: E402
from decode_steps import OursStep  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402
from perf_paths import RESULTS  # noqa: E402
from trained_tiny import corpus, train_tiny  # noqa: E402

# (row name, model.quantization, model.dtype, int4 group)
FORMATS = [("fp32", None, "float32", 64), ("bf16", None, "bfloat16", 64),
           ("fp8", "fp8", "float32", 64), ("int8", "int8", "float32", 64),
           ("int8/bf16", "int8", "bfloat16", 64), ("int4-g64", "int4", "float32", 64),
           ("int4-g32", "int4", "float32", 32), ("int4-g64/bf16", "int4", "bfloat16", 64)]
# the op before the measured rules: the weight-only kernels at every row count
WEIGHT_ONLY = {key: {"1": [[None, "weight_only"]]} for key in cpu_qgemm_rules.KEYS}
SPEED = dict(family="mixtral", vocab_size=1024, hidden_size=512, num_layers=4, num_heads=8,
             num_kv_heads=4, head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=1024,
             max_position_embeddings=2048)


def _load(path, q, dtype, group, fmt="safetensors"):
    from megainfer.config import LoadConfig
    return LoadConfig(path=path, load_format=fmt, dtype=dtype, quantization=q,
                      quantization_group_size=group)


@torch.inference_mode()
def teacher_forced(model, seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, L] token ids -> (log-probs of the next token [n, L-1, V] float32, targets)."""
    out = []
    for s in seqs:
        logits = model.compute_logits(model(s, torch.arange(len(s))))  # [L, V]
        out.append(torch.log_softmax(logits[:-1].float(), -1))
    return torch.stack(out), seqs[:, 1:]


def accuracy(a, path) -> list[dict]:
    from megainfer import LLM, SamplingParams
    from megainfer.config import ModelConfig
    from megainfer.models import build_model
    cfg = ModelConfig.from_pretrained(path)
    seqs = corpus(a.eval_seqs, 256, cfg.vocab_size, seed=1)
    prompts = corpus(a.gen_prompts, 32, cfg.vocab_size, seed=2).tolist()
    params = SamplingParams(temperature=0, max_tokens=a.gen_tokens, ignore_eos=True)
    rows, ref_lp, ref_gen = [], None, None
    for name, q, dtype, group in FORMATS:
        model = build_model(cfg, _load(path, q, dtype, group))
        lp, tgt = teacher_forced(model, seqs)
        nll = -lp.gather(-1, tgt[..., None]).squeeze(-1)  # [n, L-1]
        llm = LLM(path, dtype=dtype, max_model_len=512, max_num_seqs=a.gen_prompts,
                  overrides=[f"model.quantization={q or 'null'}",
                             f"model.quantization_group_size={group}"])
        gen = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        if ref_lp is None:
            ref_lp, ref_gen = lp, gen
        top = ref_lp.argmax(-1)  # fp32's greedy choice at every position
        row = dict(format=name, quantization=q, dtype=dtype, group_size=group,
                   perplexity=math.exp(float(nll.mean())),
                   greedy_agreement=float((lp.argmax(-1) == top).float().mean()),
                   positions=int(top.numel()),
                   mean_abs_dlogprob=float((lp.gather(-1, top[..., None]) -
                                            ref_lp.gather(-1, top[..., None])).abs().mean()),
                   generated_agreement=sum(x == y for g, r in zip(gen, ref_gen)
                                           for x, y in zip(g, r)) / sum(map(len, ref_gen)),
                   generated_tokens=sum(map(len, gen)))
        rows.append(row)
        print(f"{name:>14}  ppl {row['perplexity']:.4f}  greedy {row['greedy_agreement']:.4f} "
              f"({row['positions']})  |dlp| {row['mean_abs_dlogprob']:.5f}  generated "
              f"{row['generated_agreement']:.4f} ({row['generated_tokens']})", flush=True)
    base = rows[0]["perplexity"]
    for r in rows:
        r["perplexity_vs_fp32"] = r["perplexity"] / base - 1
    return rows


def step_bytes(model, B: int, ctx: int) -> int:
    """Bytes one decode step reads: every parameter but the embedding (experts scaled to the
    share the batch can hit) and the KV cache in the model dtype."""
    cfg = model.config
    hit = min(cfg.num_experts, B * cfg.top_k) / cfg.num_experts
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        n = p.numel() * p.element_size()
        total += n * hit if ".mlp.experts." in name else n
    dt = model.lm_head.weight.element_size()
    kv = dt * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * B * (ctx + 1)
    return int(total + kv)


def speed_variants(before: bool) -> list[tuple]:
    """(row name, quantization, dtype, group, rule table or None) of the speed table."""
    out = [(name, q, dtype, group, None) for name, q, dtype, group in FORMATS]
    if before:
        out += [(name + " before", q, dtype, group, WEIGHT_ONLY)
                for name, q, dtype, group in FORMATS if q in ("int8", "int4") and
                name != "int4-g32"]
    return out


def speed(a) -> tuple[list[dict], dict]:
    from megainfer.config import ModelConfig
    from megainfer.models import build_model
    cfg = ModelConfig(**SPEED)
    variants = speed_variants(a.before)
    by_format, models = {}, {}
    for name, q, dtype, group, _ in variants:  # a "before" row shares its format's model
        if (q, dtype, group) not in by_format:
            by_format[q, dtype, group] = build_model(cfg, _load(None, q, dtype, group,
                                                                fmt="dummy"))
        models[name] = by_format[q, dtype, group]
    rows, bws = [], {}
    for threads in a.threads:
        torch.set_num_threads(threads)
        bw = bws[threads] = max(bench_offline.read_bandwidth() for _ in range(3))
        for B in a.batches:  # formats interleaved step by step: a busy host slows them alike
            steps = {}
            for name, q, dtype, group, table in variants:
                steps[name] = (OursStep(models[name], B, a.context), table)
                if dtype != "float32":
                    steps[name][0].caches = [c.to(getattr(torch, dtype))
                                             for c in steps[name][0].caches]
                with cpu_qgemm_rules.use_rules(table):
                    for _ in range(2):
                        steps[name][0]()
            ts = {name: [] for name in steps}
            for _ in range(a.repeats):
                for name, (step, table) in steps.items():
                    with cpu_qgemm_rules.use_rules(table):
                        t = time.perf_counter()
                        step()
                        ts[name].append(time.perf_counter() - t)
            for name in steps:
                nbytes = step_bytes(models[name], B, a.context)
                rows.append(dict(format=name, B=B, threads=threads,
                                 median_s=statistics.median(ts[name]), bytes=nbytes,
                                 floor_s=nbytes / bw, load_average=os.getloadavg()[0]))
                r = rows[-1]
                print(f"{name:>21}  thr {threads} B={B:<3} {r['median_s'] * 1e3:8.2f} ms  "
                      f"({nbytes / 2**20:.1f} MiB, load {r['load_average']:.1f})", flush=True)
    fp32 = {(r["B"], r["threads"]): r["median_s"] for r in rows if r["format"] == "fp32"}
    for r in rows:
        r["speedup_vs_fp32"] = fp32[r["B"], r["threads"]] / r["median_s"]
        r["x_floor"] = r["median_s"] / r["floor_s"]
        print(f"{r['format']:>21}  thr {r['threads']} B={r['B']:<3} {r['median_s'] * 1e3:8.2f} "
              f"ms  x{r['speedup_vs_fp32']:.2f} vs fp32  {r['x_floor']:.2f}x its floor",
              flush=True)
    return rows, {str(t): bw for t, bw in bws.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trained-steps", type=int, default=800)
    ap.add_argument("--trained-ckpt", default=None, help="kept here (trained there if missing)")
    ap.add_argument("--eval-seqs", type=int, default=24)  # 24 x 255 = 6120 positions
    ap.add_argument("--gen-prompts", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=256)  # 16 x 256 = 4096 tokens
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--no-before", dest="before", action="store_false",
                    help="no 'before' rows (the weight-only kernels at every row count)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_weight_formats.json"))
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-accuracy", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads[0])
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               machine=platform.processor() or platform.machine(), torch=torch.__version__,
               load_average=os.getloadavg()[0], args=vars(a))
    fn = a.out
    if a.no_accuracy and os.path.exists(fn):  # keep the accuracy rows of the last full run
        with open(fn) as f:
            last = json.load(f)
        if "accuracy" in last:
            out["accuracy"] = last["accuracy"]
            out["accuracy_from"] = dict(date=last["date"], args=last["args"],
                                        load_average=last.get("load_average"))
    if not a.no_accuracy:
        path = a.trained_ckpt or os.path.join(tempfile.mkdtemp(), "trained-mixtral")
        if not os.path.isdir(path):
            out["trained"] = train_tiny("mixtral", path, steps=a.trained_steps)
            print(f"trained: {out['trained']}", flush=True)
        out["accuracy"] = accuracy(a, path)
    if not a.no_speed:
        out["speed"], out["read_bandwidth"] = speed(a)
    out["load_average_end"] = os.getloadavg()[0]
    fn = write_json(fn, out)
    print(f"wrote {fn}")


if __name__ == "__main__":
    main()
