"""How ``cache.kv_cache_dtype`` moves the planner's best plan: batch, throughput and cost.

    python perf/plan/plan_kv_dtype.py [--slo-ms 150] [--no-plot]

For each (model preset, hardware profile, workload) the disaggregated planner (datasheet
roofline, ``megainfer-plan`` with ``cache.kv_cache_dtype=...``) is run once per KV format; the
``auto`` (bf16) row is the baseline of the same run. Per format: KV bytes per token on one
attention rank (tp 1; block scales counted as the engine stores them), the best plan, its global
batch B (and B per attention device: the planner ranks by tokens per dollar, so a smaller
cache may buy fewer devices rather than a larger B), what bound the batch (kv_memory or
tpot_slo), tokens/s per device and dollars per million tokens. Writes
perf/results/plan_kv_dtype.json and a figure plan_kv_dtype.png (B per attention device and
$/Mtok per format).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402

from megainfer.bench.shapes import load_shape  # noqa: E402
from megainfer.perfmodel.model.hardware import load_hardware  # noqa: E402
from megainfer.perfmodel.model.disagg import Workload  # noqa: E402
from megainfer.perfmodel.plan.planner import PlanError, SearchSpace, plan_disaggregated  # noqa: E402

# (kv_cache_dtype, kv_scale_granularity); fp8_e5m2 costs the same bytes as fp8_e4m3
FORMATS = (("auto", "token_head"), ("fp8_e4m3", "token_head"), ("fp8_e4m3", "tensor"),
           ("fp4_e2m1", "token_head"), ("fp4_e2m1", "tensor"))
CASES = (("mixtral_8x22b", "h100", Workload(1024, 512)),
         ("mixtral_8x22b", "h100", Workload(8192, 1024)),
         ("deepseek_v3", "h200", Workload(8192, 1024)))


def best_per_format(model: str, hw_name: str, wl: Workload, slo_s: float) -> list[dict]:
    hw = load_hardware(hw_name)
    space = SearchSpace(tpot_slo_s=slo_s)
    rows = []
    for fmt, gran in FORMATS:
        shape = dataclasses.replace(load_shape(model), kv_cache_dtype=fmt, kv_scale_granularity=gran)
        row = {"kv_cache_dtype": fmt, "kv_scale_granularity": gran, "label": _label(fmt, gran),
               "kv_bytes_per_token": shape.kv_bytes_per_token()}
        try:
            r = plan_disaggregated(shape, [hw], wl, space, "bfloat16", heterogeneous=False,
                                   use_fit=False)[0]
        except PlanError as e:
            rows.append({**row, "error": str(e)})
            continue
        p = r.pred
        row.update(plan=p.plan.label(), m=p.plan.m, batch=p.plan.batch, binding=r.binding,
                   devices=p.plan.devices, tpot_ms=p.t_iter * 1e3,
                   batch_per_attn_dev=p.plan.batch / (p.plan.n_a * p.plan.tp_a),
                   tok_s_per_device=p.tokens_per_s_per_device,
                   usd_per_mtok=1e6 / p.tokens_per_dollar)
        rows.append(row)
    base = rows[0]
    for row in rows:
        if "batch" in row and "batch" in base:
            row["batch_x"] = row["batch"] / base["batch"]
            row["cost_x"] = row["usd_per_mtok"] / base["usd_per_mtok"]
    return rows


def _label(fmt: str, gran: str) -> str:
    return fmt if fmt == "auto" else f"{fmt}/{gran}"


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(FORMATS)
    for j, (fmt, gran) in enumerate(FORMATS):
        xs = [i + (j - (len(FORMATS) - 1) / 2) * width for i in range(len(results))]
        rows = [next(r for r in c["formats"] if r["label"] == _label(fmt, gran)) for c in results]
        axes[0].bar(xs, [r.get("batch_per_attn_dev", 0) for r in rows], width, label=_label(fmt, gran))
        axes[1].bar(xs, [r.get("usd_per_mtok", 0) for r in rows], width, label=_label(fmt, gran))
    labels = [f"{c['model']}\n{c['hardware']} in={c['input_len']} out={c['output_len']}"
              for c in results]
    titles = ("best plan's batch per attention device", "best plan's $ per Mtok")
    for ax, title in zip(axes, titles):
        ax.set_xticks(range(len(results)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slo-ms", type=float, default=150.0)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out", default=os.path.join(RESULTS, "plan_kv_dtype.json"))
    a = ap.parse_args(argv)
    t0 = time.time()
    results = []
    print(f"{'case':<44}{'kv_cache_dtype':<21}{'KV B/tok':>10}  {'best plan':<34}{'m':>2}"
          f"{'B':>7}{'B x':>6}{'B/attn':>8}{'tok/s/dev':>10}{'$/Mtok':>8}{'cost x':>7}  binding")
    for model, hw, wl in CASES:
        rows = best_per_format(model, hw, wl, a.slo_ms / 1e3)
        case = f"{model} {hw} in={wl.input_len} out={wl.output_len}"
        results.append({"model": model, "hardware": hw, "input_len": wl.input_len,
                        "output_len": wl.output_len, "formats": rows})
        for r in rows:
            if "error" in r:
                print(f"{case:<44}{r['label']:<21}  {r['error']}")
                continue
            print(f"{case:<44}{r['label']:<21}{r['kv_bytes_per_token']:>10.0f}  "
                  f"{r['plan']:<34}{r['m']:>2}{r['batch']:>7}{r['batch_x']:>6.2f}"
                  f"{r['batch_per_attn_dev']:>8.0f}"
                  f"{r['tok_s_per_device']:>10.1f}{r['usd_per_mtok']:>8.3f}{r['cost_x']:>7.2f}"
                  f"  {r['binding']}")
    if not a.no_plot:
        plot(results, os.path.splitext(a.out)[0] + ".png")
    write_json(a.out, {"bench": "plan_kv_dtype", "date": datetime.datetime.utcnow().isoformat()
                       + "Z", "host": platform.node(), "slo_ms": a.slo_ms,
                       "times": "roofline (datasheet profiles)", "cases": results,
                       "seconds": time.time() - t0})


if __name__ == "__main__":
    main()
