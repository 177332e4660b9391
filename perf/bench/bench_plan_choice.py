"""Does ``deploy=auto`` pick a fast plan? The planner's choice vs the plans one would try by hand.

    python perf/bench/bench_plan_choice.py [--ranks 4 --repeats 2 --prompts 32 --input-len 64 --max-tokens 32]
    python perf/bench/bench_plan_choice.py --pool perf/results/bench_plan_choice*.json --out X.json  # no runs

Runs ``mpiexec -n N megainfer-launch`` on one job (the pipeline_bench shape of
conf/plan_model/pipeline_bench.yaml, dummy weights, random prompts, eos ignored): first with
``deploy=auto`` (the planner chooses; its "[plan] chosen:" log line is read back), then with
each hand-tried split pinned by ``deploy.*`` keys. Rounds alternate over the plans; the table
shows each plan's median output tokens/s (the job summary's; the chosen plan's median pools
its pinned and its deploy=auto runs) and the model's predicted iteration time; the plan order
rotates each round so no plan always runs in the same slot. Also printed: the paired figure,
per plan the median over rounds of deploy=auto's tok/s over that plan's tok/s in the same round
(load drifts over minutes on a shared machine; a round's runs share it), and the load average
per round. Writes ``perf/results/bench_plan_choice.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from mpi_launch import MPIEXEC, run_ranks  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402

LAUNCH = os.path.join(os.path.dirname(sys.executable), "megainfer-launch")
SHAPE = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8, "head_dim": 64,
         "num_experts": 4, "top_k": 2, "moe_intermediate_size": 896, "vocab_size": 512}


def hand_plans(n: int) -> list[tuple]:
    """(attention_replicas, attention_tp, expert_ranks, m): every tp-1 split at m = 1 and 2,
    and tp 2 with the rest experts."""
    out = [(a, 1, n - a, m) for a in range(1, n) for m in (1, 2)]
    if n >= 3:
        out += [(1, 2, n - 2, m) for m in (1, 2)]
    return out


def job_args(a, run_dir: str) -> list[str]:
    return ([f"model.arch.{k}={v}" for k, v in SHAPE.items()]
            + ["model.arch.max_position_embeddings=1024", "workload=random",
               f"workload.num_prompts={a.prompts}", f"workload.input_len={a.input_len}",
               f"sampling.max_tokens={a.max_tokens}", "sampling.ignore_eos=true",
               "io.progress=false", "io.resume=false", "deploy.hardware=cpu_node",
               f"hydra.run.dir={run_dir}"])


def run(a, plan, tmp: str, tag: str) -> dict:
    run_dir = os.path.join(tmp, tag)
    pins = [] if plan is None else [f"deploy.attention_replicas={plan[0]}",
                                    f"deploy.attention_tp={plan[1]}",
                                    f"deploy.expert_ranks={plan[2]}", f"deploy.micro_batches={plan[3]}"]
    p = run_ranks([MPIEXEC, "-n", str(a.ranks), LAUNCH, *job_args(a, run_dir), *pins],
                  a.timeout, capture=True)
    if p.returncode:
        raise RuntimeError(f"launch {tag} failed:\n{p.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    text = p.stdout + p.stderr
    for name in os.listdir(run_dir):
        if name.endswith(".log"):
            with open(os.path.join(run_dir, name)) as f:
                text += f.read()
    return {"tok_s": s["output_tokens_per_s"], "elapsed_s": s["elapsed_s"], "log": text}


def parse_choice(log: str) -> tuple:
    m = re.search(r"\[plan\] chosen: A(\d+)x tp(\d+) \+ E(\d+)x tp1 m=(\d+).*iteration ([\d.e+-]+) ms", log)
    if not m:
        raise RuntimeError("no '[plan] chosen:' line in the deploy=auto log:\n" + log[-2000:])
    return tuple(int(x) for x in m.groups()[:4]), float(m.group(5))


def predicted(a, plan, background: float = 0.0) -> float:
    """The model's iteration time (ms) for a pinned plan (the same search, one candidate), with
    ``background`` other runnable threads on the node (``node.background_load``)."""
    from megainfer.perfmodel.model.disagg import Workload
    from megainfer.perfmodel.model.hardware import load_hardware, with_background_load
    from megainfer.perfmodel.model.shapes import ModelShape
    from megainfer.perfmodel.plan.world_plan import JobLoad, Pins, plan_world
    shape = ModelShape(name="pipeline_bench", **SHAPE)
    hw = with_background_load(load_hardware("cpu_node"), background)
    r = plan_world(shape, hw, JobLoad(a.prompts, 64, Workload(a.input_len, a.max_tokens)), a.ranks, Pins(*plan))
    return r[0].pred.t_iter * 1e3


def m_ratio_check(paths: list, ranks: int) -> dict:
    """What m = 2 costs: per split (A, tp, E) and round with a recorded load average, the m = 2
    run's tok/s over the m = 1 run's, measured and predicted; the prediction alone on the node
    (background 0) and with node.background_load = max(0, load average - ranks) (the load average
    counts this job's ranks too). Per split the median over rounds of each."""
    a = argparse.Namespace(prompts=32, input_len=64, max_tokens=24, ranks=ranks)
    per: dict = {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        for r, load in enumerate(d.get("load_average_per_round") or []):
            row = {tuple(p["plan"]): p["tok_s"][r] for p in d["plans"] if len(p["tok_s"]) > r}
            b = max(0.0, load - ranks)
            for p in row:
                if p[3] == 2 and p[:3] + (1,) in row:
                    one = p[:3] + (1,)
                    per.setdefault(p[:3], []).append((row[p] / row[one], predicted(a, one) / predicted(a, p),
                                                      predicted(a, one, b) / predicted(a, p, b)))
    out = {"job_time": job_time_check(paths, ranks)}
    for split, v in per.items():
        meas, alone, bg = (statistics.median(x[k] for x in v) for k in range(3))
        out["A%dx tp%d + E%d" % split] = {"rounds": len(v), "measured": meas, "model_alone": alone,
                                          "model_background": bg, "err_alone": alone / meas - 1,
                                          "err_background": bg / meas - 1}
    return out


def job_time_check(paths: list, ranks: int) -> dict:
    """Each run's job time (32 x 24 output tokens / its tok/s) against the job simulator's
    (32 prompts of 64 tokens at t = 0, scheduler 64 seqs / 512 tokens), alone on the node and
    with background load = max(0, load average - ranks): median error and median |error|."""
    import numpy as np
    from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
    from megainfer.perfmodel.model.hardware import load_hardware, with_background_load
    from megainfer.perfmodel.model.layer_times import layer_times_for
    from megainfer.perfmodel.model.shapes import ModelShape
    from megainfer.perfmodel.plan.world_plan import _slots
    from megainfer.perfmodel.sim.events import Requests
    from megainfer.perfmodel.sim.job import JobConfig, simulate_job
    shape, hw0 = ModelShape(name="pipeline_bench", **SHAPE), load_hardware("cpu_node")
    reqs = Requests(np.zeros(32), np.full(32, 64), np.full(32, 24))

    def sim(p, b):
        hw = with_background_load(hw0, b)
        s = _slots(shape, p[2])
        t = layer_times_for(hw, s, "float32", True)
        r = simulate_job(DisaggModel(s, t, t, Workload(64, 24), "float32"),
                         Plan(p[1], p[0], 1, p[2], p[3], 32, hw.name, hw.name), reqs, JobConfig(64, 512))
        return float(np.nanmax(r.finish_s))
    err: dict = {"alone": [], "background": []}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        for r, load in enumerate(d.get("load_average_per_round") or []):
            for p in d["plans"]:
                meas = 32 * 24 / p["tok_s"][r]
                err["alone"].append(sim(p["plan"], 0.0) / meas - 1)
                err["background"].append(sim(p["plan"], max(0.0, load - ranks)) / meas - 1)
    return {k: {"runs": len(v), "median_err": float(np.median(v)), "median_abs_err": float(np.median(np.abs(v)))}
            for k, v in err.items() if v}


def paired_ratios(runs: dict, plans: list) -> dict:
    """Per plan, the median over rounds of (deploy=auto's run / the plan's run in the same
    round): the load of this shared machine drifts over minutes, and a round's runs share it,
    so the per-round ratio cancels most of what a ratio of medians keeps. The chosen plan
    itself gets its pinned run's ratio (two runs of one plan: the noise floor)."""
    return {p: statistics.median(a / b for a, b in zip(runs["auto"], runs[p])) for p in plans}


def pooled(paths: list, ranks: int) -> dict:
    """Every round of several result files, each plan's run divided by that round's median
    over the plans (load cancels within a round); per plan the median and mean over rounds,
    beside the model's predicted iteration and its choice today."""
    norm: dict = {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        for r in range(len(d["auto_tok_s"])):  # the first len(auto) runs of each plan are pinned
            row = {tuple(p["plan"]): p["tok_s"][r] for p in d["plans"] if len(p["tok_s"]) > r}
            mid = statistics.median(row.values())
            for p, v in row.items():
                norm.setdefault(p, []).append(v / mid)
    a = argparse.Namespace(prompts=32, input_len=64, max_tokens=24, ranks=ranks)
    rows = sorted(({"plan": p, "rounds": len(v), "median": statistics.median(v), "mean": statistics.mean(v),
                    "predicted_iter_ms": predicted(a, p)} for p, v in norm.items()),
                  key=lambda r: -r["median"])
    return {"files": [os.path.basename(x) for x in paths], "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_plan_choice.json"))
    ap.add_argument("--pool", nargs="+", help="result files to pool (no runs): each plan's tok/s "
                    "over its round's median, median and mean over every round")
    a = ap.parse_args()
    if a.pool:
        res = pooled(a.pool, a.ranks)
        best = res["rows"][0]
        print(f"{'plan (A x tp + E, m)':<26} {'rounds':>6} {'median':>7} {'mean':>6} {'vs best':>7} {'pred iter ms':>12}")
        for r in res["rows"]:
            p = r["plan"]
            print(f"A{p[0]}x tp{p[1]} + E{p[2]}, m={p[3]:<10} {r['rounds']:6d} {r['median']:7.3f} {r['mean']:6.3f} "
                  f"{r['median'] / best['median']:7.3f} {r['predicted_iter_ms']:12.1f}")
        chk = m_ratio_check(a.pool, a.ranks)
        print("\nm = 2 / m = 1 tok/s per split, median over rounds with a load average (model: alone | "
              "with background load = load average - ranks)")
        jt = chk.pop("job_time")
        for k, v in jt.items():
            print(f"job time vs the job simulator, {k}: median error {100 * v['median_err']:+.0f} %, "
                  f"median |error| {100 * v['median_abs_err']:.0f} % ({v['runs']} runs)")
        for k, v in chk.items():
            print(f"{k:<18} rounds {v['rounds']}  measured {v['measured']:.2f}  model {v['model_alone']:.2f} "
                  f"({100 * v['err_alone']:+.0f} %) | {v['model_background']:.2f} ({100 * v['err_background']:+.0f} %)")
        write_json(a.out, {"date": datetime.datetime.utcnow().isoformat(timespec="seconds"), **res,
                           "m2_over_m1": chk, "job_time_vs_sim": jt})
        return
    plans = hand_plans(a.ranks)
    runs: dict = {"auto": []}
    loads: list = []  # 1-min load average at the end of each round
    runs.update({p: [] for p in plans})
    chosen = None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            res = run(a, None, tmp, f"auto{r}")
            c, t_pred = parse_choice(res["log"])
            if chosen not in (None, c):
                raise RuntimeError(f"deploy=auto chose {chosen} then {c}")
            chosen = c
            runs["auto"].append(res["tok_s"])
            for p in plans[r % len(plans):] + plans[:r % len(plans)]:  # rotate: no fixed slot
                runs[p].append(run(a, p, tmp, f"{'_'.join(map(str, p))}_{r}")["tok_s"])
                print(f"round {r} plan {p}: {runs[p][-1]:.1f} tok/s", flush=True)
            print(f"round {r} auto {chosen}: {runs['auto'][-1]:.1f} tok/s", flush=True)
            loads.append(os.getloadavg()[0])
    paired = paired_ratios(runs, plans)
    if chosen in runs:  # deploy=auto ran the same plan as this pinned one: pool their runs
        runs[chosen] = runs[chosen] + runs["auto"]
    med = {k: statistics.median(v) for k, v in runs.items()}
    fastest = max(plans, key=lambda p: med[p])
    rows = []
    print(f"\n{'plan (A x tp + E, m)':<26} {'tok/s':>8} {'vs fastest':>10} {'pred iter ms':>12}")
    for p in sorted(plans, key=lambda p: -med[p]):
        pr = predicted(a, p)
        mark = "  <- chosen" if p == chosen else ""
        print(f"A{p[0]}x tp{p[1]} + E{p[2]}, m={p[3]:<10} {med[p]:8.1f} {med[p] / med[fastest]:10.3f} "
              f"{pr:12.1f}{mark}")
        rows.append({"plan": p, "tok_s": runs[p], "median_tok_s": med[p], "predicted_iter_ms": pr})
    ratio = med.get(chosen, med["auto"]) / med[fastest]  # the chosen plan's runs, auto ones included
    ok = ratio >= 0.9
    worst = min(paired, key=lambda p: paired[p])
    print(f"paired (per round: deploy=auto's run / that plan's run, median over rounds): worst "
          f"{paired[worst]:.3f} vs A{worst[0]}x tp{worst[1]} + E{worst[2]} m={worst[3]}; load average "
          f"per round {', '.join(f'{x:.1f}' for x in loads)}")
    print(f"\ndeploy=auto chose A{chosen[0]}x tp{chosen[1]} + E{chosen[2]} m={chosen[3]} (predicted "
          f"iteration {t_pred:.1f} ms): {med.get(chosen, med['auto']):.1f} tok/s (median of its pinned and auto runs) = {ratio:.3f} of the fastest hand plan "
          f"(A{fastest[0]}x tp{fastest[1]} + E{fastest[2]} m={fastest[3]}); within 10%: {ok}")
    write_json(a.out, {"date": datetime.datetime.utcnow().isoformat(timespec="seconds"),
                       "host": platform.node(), "cpus": os.cpu_count(), "args": vars(a),
                       "chosen": chosen, "auto_tok_s": runs["auto"], "auto_median_tok_s": med["auto"],
                       "fastest": fastest, "auto_over_fastest": ratio, "within_10pct": ok,
                       "paired_auto_over_plan": {"_".join(map(str, p)): v for p, v in paired.items()},
                       "paired_worst": paired[worst], "paired_within_10pct": paired[worst] >= 0.9,
                       "load_average_per_round": loads, "plans": rows})


if __name__ == "__main__":
    main()
