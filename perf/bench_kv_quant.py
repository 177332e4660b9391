"""Low-bit KV cache: accuracy against the full-precision cache, and capacity at a fixed budget.

    python perf/bench_kv_quant.py [--positions 512 --big-positions 512 --chunk 128]

For each family's tiny model (``megainfer.tools.make_tiny``; DeepSeek with qk_rope_head_dim=16
so that fp4 can pack its k_pe) and a ~49M-parameter Mixtral-shaped one (conf/model/bench50m.yaml,
dummy weights), one random token sequence is teacher-forced through the paged cache in chunks
of ``--chunk`` tokens (every attention read goes through the cache: the first chunk sets the
per-layer scales, later chunks read quantised context). Per ``cache.kv_cache_dtype``, against
the full-precision cache of the same run: top-1 agreement of the next token, mean KL(full ||
quantised) of the next-token distribution, max |logit error|. ``fp4_e2m1/per-tensor`` is the
ablation: the same 4-bit codes with the per-tensor scale alone (block scales fixed).
``bf16-cache`` (GQA models) is the reference point for how sensitive these random-weight models
are: the fp32 cache rounded to bf16.
Capacity: KV blocks and max concurrent max_model_len sequences in ``--budget-gib`` with a bf16
model (``derive_num_blocks``). Writes ``perf/results/bench_kv_quant.json``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_io import write_json  # noqa: E402

from megainfer.config import LoadConfig, ModelConfig  # noqa: E402
from megainfer.engine.sizing import derive_num_blocks  # noqa: E402
from megainfer.kernels import kv_quant  # noqa: E402
from megainfer.models.attention import AttentionMetadata  # noqa: E402
from megainfer.models.kv_spec import kv_cache_spec_for, kv_format_error  # noqa: E402
from megainfer.models.loader import build_model  # noqa: E402

VARIANTS = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "fp4_e2m1/per-tensor")
FLOOR = "bf16-cache"  # reference point: the same cache rounded to bf16 (what a bf16 model caches)
GOALS = {"fp8_e4m3": 0.99, "fp8_e5m2": 0.99, "fp4_e2m1": 0.95}


def models(tmp: str):
    from megainfer.tools.make_tiny import make_tiny
    for fam in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        kw = {"qk_rope_head_dim": 16} if fam == "deepseek_v3" else {}
        path = make_tiny(fam, os.path.join(tmp, fam), **kw)
        cfg = ModelConfig.from_pretrained(path)
        yield f"tiny-{fam}", cfg, LoadConfig(path=path, load_format="safetensors",
                                             dtype="float32")
    from omegaconf import OmegaConf

    from megainfer.launch.settings import model_config_from_arch
    arch = OmegaConf.load(os.path.join(HERE, "..", "conf", "model", "bench50m.yaml")).arch
    cfg = model_config_from_arch(OmegaConf.to_container(arch))
    yield "bench50m-mixtral", cfg, LoadConfig(load_format="dummy", dtype="float32", seed=0)


def forced_logits(model, cfg, ids: torch.Tensor, fmt: str, chunk: int, BS: int = 16,
                  dtype: torch.dtype = torch.float32):
    """Teacher forcing through a paged cache in ``fmt`` (auto: ``dtype``): logits [N, V] fp32."""
    N = ids.shape[0]
    nb = -(-N // BS)
    caches = kv_cache_spec_for(cfg, dtype=dtype, kv_format=fmt).allocate(nb, BS)
    table, out = [list(range(nb))], []
    with torch.inference_mode():
        for s in range(0, N, chunk):
            n = min(chunk, N - s)
            meta = AttentionMetadata.build([n], [s], table, BS)
            h = model(ids[s:s + n], torch.arange(s, s + n), meta, caches)
            out.append(model.compute_logits(h))
    return torch.cat(out)


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"top1_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
            "mean_kl": kl.mean().item(), "max_logit_err": (ref - got).abs().max().item()}


def capacity(cfg, budget: float, max_model_len: int, BS: int = 16) -> dict:
    out = {}
    for fmt in ("auto",) + VARIANTS[:3]:
        if kv_format_error(cfg, fmt):
            out[fmt] = None
            continue
        blocks = derive_num_blocks(cfg, max_model_len, 10**9, BS, budget, torch.bfloat16,
                                   kv_cache_dtype=fmt)
        out[fmt] = {"blocks": blocks, "max_seqs": blocks // -(-max_model_len // BS)}
    base = out["auto"]["blocks"]
    for fmt in VARIANTS[:3]:
        if out[fmt]:
            out[fmt]["ratio_vs_bf16"] = out[fmt]["blocks"] / base
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--positions", type=int, default=512, help="teacher-forced tokens (tiny)")
    ap.add_argument("--big-positions", type=int, default=512, help="idem, bench50m")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk (tokens)")
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_kv_quant.json"))
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.time()
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg, load in models(tmp):
            model = build_model(cfg, load).eval()
            N = a.big_positions if name.startswith("bench") else a.positions
            N = min(N, cfg.max_position_embeddings)
            ids = torch.randint(0, cfg.vocab_size, (N,), generator=torch.Generator().manual_seed(1))
            t = time.time()
            ref = forced_logits(model, cfg, ids, "auto", a.chunk)
            res = {"positions": N, "logit_std": ref.std().item(),
                   "capacity": capacity(cfg, a.budget_gib, a.max_model_len), "formats": {}}
            if not cfg.is_mla:  # (the MLA torch path computes in the latent's own dtype)
                m = compare(ref, forced_logits(model, cfg, ids, "auto", a.chunk,
                                               dtype=torch.bfloat16))
                res["formats"][FLOOR] = m
                rows.append((name, FLOOR, m))
            for var in VARIANTS:
                fmt = var.split("/")[0]
                if kv_format_error(cfg, fmt):
                    res["formats"][var] = None
                    rows.append((name, var, None))
                    continue
                kv_quant.FP4_BLOCK_SCALES = not var.endswith("per-tensor")
                try:
                    m = compare(ref, forced_logits(model, cfg, ids, fmt, a.chunk))
                finally:
                    kv_quant.FP4_BLOCK_SCALES = True
                res["formats"][var] = m
                rows.append((name, var, m))
            res["seconds"] = time.time() - t
            results[name] = res
    print(f"\n{'model':<20}{'kv_cache_dtype':<22}{'top1':>8}{'mean KL':>11}{'max|dlogit|':>13}"
          f"{'blocks x':>10}")
    for name, var, m in rows:
        cap = results[name]["capacity"].get(var)
        ratio = f"{cap['ratio_vs_bf16']:.2f}" if cap else ""
        if m is None:
            print(f"{name:<20}{var:<22}{'n/a (head dims not a multiple of 16)':>42}")
            continue
        print(f"{name:<20}{var:<22}{m['top1_agreement']:>8.4f}{m['mean_kl']:>11.2e}"
              f"{m['max_logit_err']:>13.4f}{ratio:>10}")
    goals = {}
    for var, g in GOALS.items():
        vals = [r["formats"][var]["top1_agreement"] for r in results.values()
                if r["formats"].get(var)]
        goals[var] = {"goal_top1": g, "min_top1": min(vals), "met": min(vals) >= g}
    blk_beats = all(r["formats"]["fp4_e2m1"]["mean_kl"]
                    < r["formats"]["fp4_e2m1/per-tensor"]["mean_kl"]
                    for r in results.values() if r["formats"].get("fp4_e2m1"))
    goals["fp4_block_scales_beat_per_tensor_kl"] = blk_beats
    print("\ngoals:", {k: (v["met"], round(v["min_top1"], 4)) if isinstance(v, dict) else v
                       for k, v in goals.items()})
    print(f"capacity at {a.budget_gib} GiB, bf16 model, max_model_len={a.max_model_len}:")
    for name, r in results.items():
        caps = r["capacity"].items()
        print(f"  {name:<20}" + "  ".join(
            f"{f}={c['blocks']} blocks/{c['max_seqs']} seqs" for f, c in caps if c))
    elapsed = time.time() - t0
    print(f"total {elapsed:.1f}s")
    write_json(a.out, {"bench": "kv_quant", "date": datetime.datetime.utcnow().isoformat() + "Z",
                       "host": platform.node(), "torch": torch.__version__, "args": vars(a),
                       "scale_policy": f"per-layer float32, set once from the first write's amax "
                                       f"x {kv_quant.SCALE_HEADROOM}",
                       "models": results, "goals": goals, "seconds": elapsed})


if __name__ == "__main__":
    main()
