"""EPLB benchmark on a skewed routing workload.

Part 1 (here now, ``bench_algorithm``): a biased router (Zipf popularity over a random
expert order per layer, top-k drawn without replacement via Gumbel noise) feeds
``ExpertLoadWindow`` for ``window`` iterations; ``rebalance_experts`` turns the window
into a placement; then fresh iterations from the same router are routed through
``Placement.choose_replicas`` and the tokens each expert rank receives are counted.
Baseline, same run: the identity placement (expert e on rank e // (N/P), no redundancy).
Reported per layer: max/mean tokens per rank; and the algorithm's run time (median).

Part 2 (``bench_runtime``, ``--runtime``): decode iteration time and per-rank load of the
disaggregated runtime before and after a live rebalance in one run (``perf/jobs/eplb_job.py``);
it adds a "runtime" key to the same JSON.

    .venv/bin/python perf/bench/bench_eplb.py [--cases tiny,dsv3] [--repeats 5]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import glob
import statistics
import sys
import tempfile
import time

import torch

from megainfer.eplb import ExpertLoadWindow, Placement, rebalance_experts
from megainfer.eplb.placement_policy import imbalance, rank_load

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from mpi_launch import run_job  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402

CASES = {
    # DeepSeek-V3-like: 58 MoE layers x 256 experts in 8 groups, top-8; 4 nodes x 8 ranks.
    "dsv3": dict(layers=58, experts=256, top_k=8, groups=8, nodes=4, ranks=32,
                 replicas=[256, 288, 320], tokens=2048, zipf=1.0),
    # our tiny test models: 8 experts top-2 on 2 expert ranks, 2 redundant slots.
    "tiny": dict(layers=4, experts=8, top_k=2, groups=1, nodes=1, ranks=2,
                 replicas=[8, 10], tokens=256, zipf=1.0),
}


class BiasedRouter:
    """Per layer: expert popularity ~ 1/rank^s over a random permutation of experts."""

    def __init__(self, layers: int, experts: int, top_k: int, zipf: float, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        rank = torch.stack([torch.randperm(experts, generator=self.g) for _ in range(layers)])
        self.logp = -zipf * torch.log(rank.double() + 1)                 # [L, N]
        self.top_k = top_k

    def route(self, layer: int, tokens: int) -> torch.Tensor:
        """topk_ids [tokens, k]: Plackett-Luce draw without replacement (Gumbel top-k)."""
        u = torch.rand(tokens, self.logp.shape[1], generator=self.g, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(u.clamp(1e-12, 1 - 1e-12)))      # [T, N]
        return (self.logp[layer] + gumbel).topk(self.top_k, dim=-1).indices


def measured_imbalance(pl: Placement, batches: list[list[torch.Tensor]]) -> torch.Tensor:
    """Route held-out batches through the placement; max/mean tokens per rank: [L]."""
    per_rank = torch.zeros(pl.num_layers, pl.num_ranks, dtype=torch.float64)  # [L, P]
    for it in batches:
        for layer, ids in enumerate(it):
            slots = pl.choose_replicas(layer, ids).flatten()                  # [T*k]
            per_rank[layer] += torch.bincount(pl.rank_of_slot(slots), minlength=pl.num_ranks)
    return imbalance(per_rank)


def summary(x: torch.Tensor) -> dict:
    return {"mean_over_layers": round(float(x.mean()), 4), "worst_layer": round(float(x.max()), 4)}


def bench_algorithm(name: str, c: dict, window: int, eval_iters: int, repeats: int, seed: int,
                    heatmap: str | None) -> list[dict]:
    router = BiasedRouter(c["layers"], c["experts"], c["top_k"], c["zipf"], seed)
    stats = ExpertLoadWindow(c["layers"], c["experts"], window)
    for _ in range(window):
        for layer in range(c["layers"]):
            stats.record(layer, router.route(layer, c["tokens"]))
        stats.end_iteration()
    if heatmap:
        stats.save_heatmap(heatmap, f"{name}: tokens per expert, last {window} iterations")
    held_out = [[router.route(l, c["tokens"]) for l in range(c["layers"])] for _ in range(eval_iters)]
    load = stats.load()                                                     # [L, N]
    ident = Placement.identity(c["layers"], c["experts"], c["ranks"])
    ident_imb = measured_imbalance(ident, held_out)
    ident_fit = imbalance(rank_load(load, ident.phy2log, c["ranks"]))
    rows = []
    for replicas in c["replicas"]:
        for policy in ("hierarchical", "global"):
            if policy == "hierarchical" and c["groups"] % c["nodes"]:
                continue
            args = (load, replicas, c["groups"], c["nodes"], c["ranks"], policy)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = rebalance_experts(*args)
                times.append(time.perf_counter() - t0)
            pl = Placement(*out, c["ranks"])
            rows.append({
                "case": name, "layers": c["layers"], "experts": c["experts"], "top_k": c["top_k"],
                "groups": c["groups"], "nodes": c["nodes"], "ranks": c["ranks"],
                "replicas": replicas, "policy": policy, "zipf": c["zipf"],
                "tokens_per_iteration": c["tokens"], "window": window, "eval_iterations": eval_iters,
                "identity_max_over_mean": summary(ident_imb),
                "rebalanced_max_over_mean": summary(measured_imbalance(pl, held_out)),
                "window_identity_max_over_mean": summary(ident_fit),
                "window_rebalanced_max_over_mean": summary(imbalance(rank_load(load, pl.phy2log, c["ranks"]))),
                "algorithm_seconds_median": statistics.median(times), "algorithm_repeats": repeats,
            })
    return rows


def bench_runtime(args) -> dict:
    """Decode iteration time and per-rank load before/after the first live rebalance.

    ``perf/jobs/eplb_job.py`` under ``mpiexec -n 3`` (1 attention + 2 expert ranks, skewed router,
    live EPLB every ``interval`` iterations, m = 1 so the two expert ranks compute while the
    attention rank waits). Before: decode steps before the first rebalance (initial placement);
    after: decode steps after it. Baseline: a control run of the same workload without EPLB
    (identity placement), its same iterations. EPLB and control runs alternate ``repeats``
    times; each figure is the median over repeats of the per-run median. Per-rank load: (token,
    slot) pairs each expert rank served per iteration, max/mean over the two ranks.
    """
    runs, controls = [], []
    for _ in range(args.runtime_repeats):
        runs.append(_summarise(_eplb_job(args, [])))
        controls.append(_summarise(_eplb_job(args, ["--static"])))
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    res = {"shape": runs[0]["shape"], "interval": runs[0]["interval"], "batch": runs[0]["batch"],
           "repeats": args.runtime_repeats, "runs": runs, "control_runs": controls}
    for key in ("decode_iter_ms_before", "decode_iter_ms_after", "expert_phase_ms_before",
                "expert_phase_ms_after", "rank_max_over_mean_before",
                "rank_max_over_mean_after", "rebalance_step_ms"):
        res[key] = med(runs, key)
    res["control_decode_iter_ms_same_iterations_before"] = med(controls, "decode_iter_ms_before")
    res["control_decode_iter_ms_same_iterations_after"] = med(controls, "decode_iter_ms_after")
    res["control_rank_max_over_mean"] = med(controls, "rank_max_over_mean_after")
    res["control_expert_phase_ms_after"] = med(controls, "expert_phase_ms_after")
    res["speedup_vs_control_same_iterations"] = statistics.median(
        c["decode_iter_ms_after"] / r["decode_iter_ms_after"] for r, c in zip(runs, controls))
    print(f"runtime (1 attention + 2 expert ranks, zipf {args.runtime_zipf}, median of "
          f"{args.runtime_repeats} alternating pairs): decode iteration "
          f"{res['decode_iter_ms_before']:.1f} ms -> {res['decode_iter_ms_after']:.1f} ms; control "
          f"run without EPLB, same iterations: {res['control_decode_iter_ms_same_iterations_before']:.1f}"
          f" -> {res['control_decode_iter_ms_same_iterations_after']:.1f} ms (EPLB "
          f"{res['speedup_vs_control_same_iterations']:.2f}x after the rebalance); per-rank max/mean "
          f"{res['rank_max_over_mean_before']:.3f} -> {res['rank_max_over_mean_after']:.3f} "
          f"(control {res['control_rank_max_over_mean']:.3f}); slowest expert rank per layer "
          f"{res['expert_phase_ms_before']:.1f} -> {res['expert_phase_ms_after']:.1f} ms (control "
          f"{res['control_expert_phase_ms_after']:.1f} ms); rebalance step "
          f"{res['rebalance_step_ms']:.1f} ms")
    return res


def _summarise(run: dict) -> dict:
    """One eplb_job run -> medians of decode iteration time and rank load, before/after."""
    k, B = run["interval"], run["batch"]
    decode = [(i, dt) for i, (seqs, toks, dt) in enumerate(run["steps"]) if seqs == toks == B]
    ratio = _rank_ratio(run)
    return {"shape": run["shape"], "interval": k, "batch": B,
            "decode_iter_ms_before": 1e3 * statistics.median(dt for i, dt in decode if i < k),
            "decode_iter_ms_after": 1e3 * statistics.median(dt for i, dt in decode if i > k),
            "rebalance_step_ms": 1e3 * run["steps"][k][2],
            "expert_phase_ms_before": run["expert_phase_ms"]["before"],
            "expert_phase_ms_after": run["expert_phase_ms"]["after"],
            "rank_max_over_mean_before": statistics.median(ratio[1:k]),
            "rank_max_over_mean_after": statistics.median(ratio[k + 1:]),
            "rebalances": [e["rebalances"] for e in run["experts"]],
            "weight_moves": [e["moved"] for e in run["experts"]]}


def _eplb_job(args, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_eplb_") as tmp:
        trace_dir = os.path.join(tmp, "trace")
        job_args = ["--zipf", args.runtime_zipf, "--interval", args.runtime_interval,
                    "--trace", trace_dir, *extra]
        if args.runtime_batch:
            job_args += ["--batch", args.runtime_batch]
        run = run_job(3, "eplb_job.py", os.path.join(tmp, "run.json"), job_args)
        run["expert_phase_ms"] = _expert_phase(trace_dir, run["interval"])
    return run


def _expert_phase(trace_dir: str, k: int) -> dict:
    """Per (iteration, layer): the slowest expert rank's compute span (what the attention rank
    waits for at m = 1); median over iterations before / after the first rebalance, in ms."""
    span = {}  # (iter, layer) -> max over expert ranks of the expert span, us
    for path in glob.glob(os.path.join(trace_dir, "trace.rank*.json")):
        with open(path) as f:
            for e in json.load(f)["traceEvents"]:
                if e.get("ph") == "X" and e.get("cat") == "expert":
                    key = (e["args"]["iter"], e["args"]["layer"])
                    span[key] = max(span.get(key, 0.0), e["dur"])
    pick = lambda keep: [v / 1e3 for (i, _), v in span.items() if keep(i)]  # noqa: E731
    return {"before": statistics.median(pick(lambda i: 0 < i < k)),
            "after": statistics.median(pick(lambda i: i > k))}


def _rank_ratio(run: dict) -> list[float]:
    """Per iteration: max/mean over expert ranks of the (token, slot) pairs they served."""
    per_iter = list(zip(*[e["tokens_per_iteration"] for e in run["experts"]]))  # [iters][ranks]
    return [max(t) / (sum(t) / len(t)) if sum(t) else 1.0 for t in per_iter]


def print_table(rows: list[dict]) -> None:
    """Held-out max/mean (mean over layers, worst layer); 'fit' is the same on the window."""
    head = (f"{'case':5} {'R':>4} {'policy':12} {'identity':>16} {'rebalanced':>16} "
            f"{'fit: ident':>10} {'rebal':>6} {'algo ms':>8}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        i, b = r["identity_max_over_mean"], r["rebalanced_max_over_mean"]
        fi, fb = r["window_identity_max_over_mean"], r["window_rebalanced_max_over_mean"]
        print(f"{r['case']:5} {r['replicas']:>4} {r['policy']:12} "
              f"{i['mean_over_layers']:6.3f} ({i['worst_layer']:5.2f}) "
              f"{b['mean_over_layers']:>7.3f} ({b['worst_layer']:5.2f}) "
              f"{fi['mean_over_layers']:>10.3f} {fb['mean_over_layers']:>6.3f} "
              f"{1e3 * r['algorithm_seconds_median']:>8.1f}")
    print("max/mean tokens per expert rank: mean over layers (worst layer), held-out iterations;"
          " fit = same on the stats window")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="tiny,dsv3")
    ap.add_argument("--window", type=int, default=8, help="stats window, iterations")
    ap.add_argument("--eval-iters", type=int, default=8, help="held-out iterations measured")
    ap.add_argument("--repeats", type=int, default=5, help="algorithm timing repeats (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf", type=float, default=None, help="router skew exponent (default per case)")
    ap.add_argument("--heatmap", default=None, help="PNG of the last case's window load")
    ap.add_argument("--runtime", action="store_true", help="also run the live-runtime part")
    ap.add_argument("--runtime-zipf", type=float, default=1.5)
    ap.add_argument("--runtime-interval", type=int, default=12)
    ap.add_argument("--runtime-repeats", type=int, default=3, help="alternating EPLB/control pairs")
    ap.add_argument("--runtime-batch", type=int, default=None, help="eplb_job --batch")
    ap.add_argument("--out", default=os.path.join(RESULTS,
                                                  "eplb_algorithm.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.cases.split(","):
        if name not in CASES:
            sys.exit(f"--cases: unknown case {name!r}; known: {', '.join(CASES)}")
        case = dict(CASES[name], **({"zipf": args.zipf} if args.zipf is not None else {}))
        rows += bench_algorithm(name, case, args.window, args.eval_iters, args.repeats,
                                args.seed, args.heatmap)
    print_table(rows)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": 1,
                    "note": "shared machine, loaded by other jobs; loads are exact, times noisy"},
        "baseline": "identity placement (expert e on rank e // (N/P), no redundant slots)",
        "metric": "per layer max/mean tokens per expert rank on held-out iterations "
                  "(replica chosen by Placement.choose_replicas)",
        "algorithm": rows,
        "runtime": bench_runtime(args) if args.runtime else None,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
