"""Paper-scale figures computed by the whole-job simulator (perfmodel/sim/job.py) on datasheet
profiles (conf/hardware/*.yaml, conf/plan_model/*.yaml), for Mixtral-8x22B and DeepSeek-V3.

Every figure below is a simulated job: B requests arrive at t = 0 (prompt 1024, output 40), are
prefilled in chunks and decode together under continuous batching; routing balanced or Zipf
(hot experts fixed per layer for the job, so the slowest expert rank sets each layer). Decode
tokens/s per GPU = B / mean full-batch decode iteration / GPUs. The planner (closed form) only
proposes deployments; the closed form's own figure is printed beside the simulator's.

1. m trend: the planner's m = 3 deployment, same global batch, m = 1..4.
2. A:E choice: that deployment's per-replica batch, tp and expert ranks, n_a varied; the best
   n_a:n_e under the TPOT SLO by the simulator (balanced, Zipf) and by the closed form.
3. Disaggregated vs colocated, tokens/s per GPU: each side's best plan under the SLO, simulated
   (colocated: perfmodel/sim/job_colocated.py).
4. Heterogeneous (H20 attention + L40S experts) vs homogeneous (H20) tokens per dollar.
5. PD goodput vs a non-PD plan at the same SLOs: the goodput search once per family (AE, PD),
   both simulated (PD as one job: perfmodel/sim/pd.py), by goodput per dollar.

Beside each figure, the paper's where the MegaScale-Infer write-up in the seeds reports one.

  python perf/plan/sim_paper_scale.py [--only pd_goodput_vs_non_pd ...]  -> tables + perf/results/sim_paper_scale.json
"""
from __future__ import annotations

import datetime
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import RESULTS  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402

from megainfer.bench.shapes import load_shape  # noqa: E402
from megainfer.perfmodel.model.colocated import ColocatedModel  # noqa: E402
from megainfer.perfmodel.sim.events import LengthDist, Routing, poisson_requests  # noqa: E402
from megainfer.perfmodel.model.hardware import load_hardware  # noqa: E402
from megainfer.perfmodel.sim.job import JobConfig, simulate_job  # noqa: E402
from megainfer.perfmodel.sim.job_colocated import simulate_colocated_job  # noqa: E402
from megainfer.perfmodel.model.layer_times import layer_times_for  # noqa: E402
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload  # noqa: E402
from megainfer.perfmodel.plan.planner import PlanError, SearchSpace, plan_colocated, plan_disaggregated  # noqa: E402

SLO = 0.150  # TPOT SLO of the planner's search and of the simulated A:E choice
PLAN_WL = Workload(1024, 512)  # what the planner sizes KV memory for
PROMPT, OUTPUT = 1024, 40  # the simulated jobs
WL = Workload(PROMPT, OUTPUT)
CASES = [("mixtral_8x22b", "h100"), ("mixtral_8x22b", "a100_80g"), ("deepseek_v3", "h800")]
ROUTINGS = (("balanced", Routing()), ("zipf1.0", Routing("zipf", 1.0)))
SEED_000 = "MegaScale-Infer as quoted in /work/shared/seeds/000 (section 6.4)"
PAPER = {  # what the seeds report; None: no figure there
    "m_gain": None,
    "ae_ratio": None,
    "disagg_vs_colocated_per_gpu": {"figure": "up to 1.90x", "source": SEED_000,
                                    "note": "per-GPU throughput vs state-of-the-art MoE serving "
                                            "systems, maximum over the paper's models"},
    "heterogeneous_per_cost": None,
}


def paper(key: str) -> str:
    p = PAPER[key]
    return p["figure"] if p else "(none in seeds)"


def times(hw, shape):
    return layer_times_for(hw, shape)


def disagg_model(shape, hw_a, hw_e=None) -> DisaggModel:
    return DisaggModel(shape, times(hw_a, shape), times(hw_e or hw_a, shape), WL)


def sim_decode(model, plan: Plan, routing: Routing, seed: int = 0, colocated: bool = False) -> dict:
    """One simulated job of ``plan.batch`` requests at t = 0: the mean full-batch decode iteration."""
    req = poisson_requests(plan.batch, 0, LengthDist("fixed", PROMPT), LengthDist("fixed", OUTPUT))
    n_a = 1 if colocated else plan.n_a
    cfg = JobConfig(max_num_seqs=-(-plan.batch // n_a), max_num_batched_tokens=1 << 17,
                    routing=routing, seed=seed)
    r = simulate_colocated_job(model, plan, req, cfg) if colocated else simulate_job(model, plan, req, cfg)
    full = [d for _, d, tok in r.iteration_s if tok == plan.batch]
    it = sum(full) / len(full)
    devices = plan.group if colocated else plan.devices
    sm = r.summary()
    return {"decode_iter_s": it, "tokens_per_s_per_gpu": plan.batch / it / devices,
            "tokens_per_s": plan.batch / it, "ttft_p50_s": sm["ttft_s_p50"], "tpot_p50_s": sm["tpot_s_p50"]}


def operating_point(shape, hw) -> Plan:
    """The planner's best m = 3 plan; B rounded down to a multiple of 12 n_a (m = 1..4 split it)."""
    p = plan_disaggregated(shape, [hw], PLAN_WL, SearchSpace(tpot_slo_s=SLO, micro_batches=(3,)))[0].pred.plan
    return Plan(p.tp_a, p.n_a, p.tp_e, p.n_e, 3, p.batch // (12 * p.n_a) * 12 * p.n_a, hw.name, hw.name)


def m_trend() -> list[dict]:
    print(f"1) m trend (simulated decode tok/s/GPU; gain vs m-1; closed form beside). Paper: {paper('m_gain')}")
    print(f"{'model':<15}{'hw':<10}{'plan':<22}{'B':>6}{'m':>3}{'routing':>10}{'iter ms':>9}"
          f"{'tok/s/GPU':>10}{'gain':>7}{'closed ms':>10}{'gain':>7}")
    rows = []
    for name, hwn in CASES:
        shape, hw = load_shape(name), load_hardware(hwn)
        op, model = operating_point(shape, hw), disagg_model(shape, hw)
        prev, prev_c = {}, None
        for m in (1, 2, 3, 4):
            plan = Plan(op.tp_a, op.n_a, op.tp_e, op.n_e, m, op.batch, hwn, hwn)
            closed = model.predict(plan).t_iter
            gain_c = prev_c / closed if prev_c else float("nan")
            prev_c = closed
            for rn, routing in ROUTINGS:
                s = sim_decode(model, plan, routing, seed=m)
                gain = s["tokens_per_s_per_gpu"] / prev[rn] if rn in prev else float("nan")
                prev[rn] = s["tokens_per_s_per_gpu"]
                rows.append({"model": name, "hardware": hwn, "plan": plan.label(), "batch": op.batch, "m": m,
                             "routing": rn, **s, "gain_vs_prev_m": gain, "closed_form_iter_s": closed,
                             "closed_form_gain": gain_c})
                print(f"{name:<15}{hwn:<10}{f'A{op.n_a}xtp{op.tp_a}+E{op.n_e}xtp{op.tp_e}':<22}{op.batch:>6}"
                      f"{m:>3}{rn:>10}{s['decode_iter_s'] * 1e3:9.2f}{s['tokens_per_s_per_gpu']:10.1f}"
                      f"{gain:7.2f}{closed * 1e3:10.2f}{gain_c:7.2f}")
    return rows


def ae_choice() -> list[dict]:
    print(f"\n2) A:E choice at the planner's m = 3 deployment (per-replica batch fixed, n_a varied; best "
          f"tok/s/GPU with TPOT <= {SLO * 1e3:.0f} ms). Paper: {paper('ae_ratio')}")
    out = []
    for name, hwn in (CASES[0], CASES[2]):
        shape, hw = load_shape(name), load_hardware(hwn)
        op, model = operating_point(shape, hw), disagg_model(shape, hw)
        per = op.batch // op.n_a
        cands = sorted({max(1, round(op.n_a * f)) for f in (0.25, 0.5, 0.75, 1, 1.5, 2, 3)})
        cand_rows = []
        for n_a in cands:
            plan = Plan(op.tp_a, n_a, op.tp_e, op.n_e, 3, per * n_a, hwn, hwn)
            row = {"n_a": n_a, "n_e": op.n_e, "batch": plan.batch,
                   "closed_form": {"tpot_s": model.predict(plan).t_iter,
                                   "tokens_per_s_per_gpu": model.predict(plan).tokens_per_s_per_device}}
            for rn, routing in ROUTINGS:
                s = sim_decode(model, plan, routing, seed=n_a)
                row[rn] = {"tpot_s": s["decode_iter_s"], "tokens_per_s_per_gpu": s["tokens_per_s_per_gpu"]}
            cand_rows.append(row)
        best = {}
        for key in ("closed_form",) + tuple(rn for rn, _ in ROUTINGS):
            ok = [r for r in cand_rows if r[key]["tpot_s"] <= SLO] or cand_rows
            b = max(ok, key=lambda r: r[key]["tokens_per_s_per_gpu"])
            best[key] = {"n_a": b["n_a"], "n_e": b["n_e"], "ratio": f"{b['n_a'] * op.tp_a}:{b['n_e'] * op.tp_e}",
                         "tokens_per_s_per_gpu": b[key]["tokens_per_s_per_gpu"], "tpot_s": b[key]["tpot_s"]}
        out.append({"model": name, "hardware": hwn, "tp_a": op.tp_a, "tp_e": op.tp_e, "per_replica_batch": per,
                    "candidates": cand_rows, "best": best})
        print(f"  {name}/{hwn} (tp_a {op.tp_a}, tp_e {op.tp_e}, {per} seqs/replica, GPUs A:E):")
        for r in cand_rows:
            print(f"    n_a {r['n_a']:>3}:n_e {r['n_e']:<3}" + "".join(
                f" | {k} {r[k]['tokens_per_s_per_gpu']:7.1f} tok/s/GPU TPOT {r[k]['tpot_s'] * 1e3:6.1f} ms"
                for k in ("closed_form", "balanced", "zipf1.0")))
        print("    best: " + ", ".join(f"{k} {v['ratio']} ({v['tokens_per_s_per_gpu']:.1f})" for k, v in best.items()))
    return out


def disagg_vs_colocated() -> dict:
    print(f"\n3) disaggregated vs colocated, simulated decode tok/s/GPU of each side's best plan under the "
          f"{SLO * 1e3:.0f} ms SLO. Paper: {paper('disagg_vs_colocated_per_gpu')}")
    out, space = {}, SearchSpace(tpot_slo_s=SLO)
    for name, hwn in CASES:
        shape, hw = load_shape(name), load_hardware(hwn)
        d = plan_disaggregated(shape, [hw], PLAN_WL, space)[0].pred.plan
        try:
            c = plan_colocated(shape, hw, PLAN_WL, space)[0].pred.plan
        except PlanError as e:
            out[f"{name}/{hwn}"] = {"colocated": f"no plan: {e}"}
            print(f"  {name}/{hwn}: colocated has no plan ({str(e)[:90]})")
            continue
        dm, cm = disagg_model(shape, hw), ColocatedModel(shape, times(hw, shape), WL)
        row = {"disaggregated_plan": d.label(), "colocated_plan": c.label(), "paper": PAPER["disagg_vs_colocated_per_gpu"]}
        for rn, routing in ROUTINGS:
            sd, sc = sim_decode(dm, d, routing), sim_decode(cm, c, routing, colocated=True)
            row[rn] = {"disaggregated": sd, "colocated": sc,
                       "ratio": sd["tokens_per_s_per_gpu"] / sc["tokens_per_s_per_gpu"]}
        row["closed_form_ratio"] = dm.predict(d).tokens_per_s_per_device / cm.predict(c).tokens_per_s_per_device
        out[f"{name}/{hwn}"] = row
        print(f"  {name}/{hwn}: {d.label()} vs {c.label()}: ratio balanced {row['balanced']['ratio']:.2f}x, "
              f"zipf1.0 {row['zipf1.0']['ratio']:.2f}x, closed form {row['closed_form_ratio']:.2f}x "
              f"(paper {paper('disagg_vs_colocated_per_gpu')})")
    return out


def heterogeneous_cost() -> dict:
    print(f"\n4) heterogeneous H20 + L40S vs H20 only: simulated tokens per dollar (illustrative prices). "
          f"Paper: {paper('heterogeneous_per_cost')}")
    out, space = {}, SearchSpace(tpot_slo_s=SLO)
    h20, l40s = load_hardware("h20"), load_hardware("l40s")
    for name in ("mixtral_8x22b", "deepseek_v3"):
        shape = load_shape(name)
        try:
            het = [r.pred for r in plan_disaggregated(shape, [h20, l40s], PLAN_WL, space)
                   if r.pred.plan.hw_a != r.pred.plan.hw_e]
            homo = plan_disaggregated(shape, [h20], PLAN_WL, space)[0].pred
        except PlanError as e:
            out[name] = f"no plan: {e}"
            print(f"  {name}: no plan ({str(e)[:90]})")
            continue
        if not het:
            out[name] = "no heterogeneous plan"
            continue
        het = het[0]
        prof = {"h20": h20, "l40s": l40s}
        row = {"heterogeneous_plan": het.plan.label(), "homogeneous_plan": homo.plan.label()}
        for rn, routing in ROUTINGS:
            r = {}
            for key, pred in (("heterogeneous", het), ("homogeneous", homo)):
                model = disagg_model(shape, prof[pred.plan.hw_a], prof[pred.plan.hw_e])
                s = sim_decode(model, pred.plan, routing)
                r[key] = {**s, "tokens_per_dollar": s["tokens_per_s"] * 3600 / pred.cost_per_hour}
            r["ratio"] = r["heterogeneous"]["tokens_per_dollar"] / r["homogeneous"]["tokens_per_dollar"]
            row[rn] = r
        row["closed_form_ratio"] = het.tokens_per_dollar / homo.tokens_per_dollar
        out[name] = row
        print(f"  {name}: {het.plan.label()} vs {homo.plan.label()}: balanced {row['balanced']['ratio']:.2f}x, "
              f"zipf1.0 {row['zipf1.0']['ratio']:.2f}x, closed form {row['closed_form_ratio']:.2f}x")
    return out


PD_CASES = [("mixtral_8x22b", "h100")]
PD_JOB = dict(requests=100, rate=4.0, prompt=2048, output=256)  # Poisson arrivals
PD_SLOS = [(1.0, 0.100), (0.4, 0.060)]  # (TTFT, TPOT) seconds, p90


def pd_goodput_vs_non_pd() -> dict:
    """5) The goodput search (``perfmodel.plan.goodput_search.search_goodput``) once per family at
    the same workload and SLOs: the best PD plan (a prefill pool feeding an AE decode pool,
    simulated as one job, ``perfmodel/sim/pd.py``) vs the best non-PD (AE) plan, each by
    goodput per dollar; every figure is a simulated job."""
    from megainfer.perfmodel.plan.goodput import Slo
    from megainfer.perfmodel.plan.goodput_search import GoodputSpace, Roles, search_goodput
    j = PD_JOB
    print(f"\n5) PD vs non-PD (AE) at the same SLOs: goodput search per family, simulated; "
          f"{j['requests']} requests, Poisson {j['rate']}/s, prompt {j['prompt']}, output "
          f"{j['output']}. Paper: (none in seeds)")
    reqs = poisson_requests(j["requests"], j["rate"], LengthDist("fixed", j["prompt"]),
                            LengthDist("fixed", j["output"]), seed=0)
    out = {"workload": j, "paper": None, "rows": []}
    for name, hwn in PD_CASES:
        shape, hw = load_shape(name), load_hardware(hwn)
        for ttft, tpot in PD_SLOS:
            slo = Slo(ttft, tpot, 90)
            row = {"model": name, "hardware": hwn, "slo_ttft_s": ttft, "slo_tpot_s": tpot, "p": 90}
            for fam in ("AE", "PD"):
                space = GoodputSpace(tp_choices=(2, 4, 8), replica_choices=(1, 2, 3, 4, 6, 8),
                                     prefill_replicas=(1, 2, 4), micro_batches=(2, 3), max_sims=20,
                                     families=(fam,))
                try:
                    b = search_goodput(shape, Roles(hw, hw, hw), reqs, slo, space).ranked[0]
                except PlanError as e:
                    row[fam] = {"status": f"no feasible plan: {e}"}
                    print(f"  {name}/{hwn} SLO {ttft * 1e3:g}/{tpot * 1e3:g} ms {fam}: no feasible plan")
                    continue
                row[fam] = {"plan": b.label(), "devices": b.devices, "goodput_req_s": b.result.goodput_req_s,
                            "req_per_dollar": b.per_dollar(),
                            "goodput_per_device": b.result.goodput_req_s / b.devices,
                            "ttft_p90_s": b.result.ttft_p, "tpot_p90_s": b.result.tpot_p,
                            "attained": b.result.fraction}
                print(f"  {name}/{hwn} SLO {ttft * 1e3:g}/{tpot * 1e3:g} ms {fam}: {b.label()} "
                      f"({b.devices} GPUs): goodput {b.result.goodput_req_s:.2f} req/s, "
                      f"{b.per_dollar():.0f} req/$, TTFT p90 {b.result.ttft_p * 1e3:.0f} ms, "
                      f"TPOT p90 {b.result.tpot_p * 1e3:.1f} ms")
            if "plan" in row.get("AE", {}) and "plan" in row.get("PD", {}):
                row["pd_over_ae_req_per_dollar"] = row["PD"]["req_per_dollar"] / row["AE"]["req_per_dollar"]
                row["pd_over_ae_goodput_per_device"] = (row["PD"]["goodput_per_device"]
                                                        / row["AE"]["goodput_per_device"])
                print(f"    PD / AE: {row['pd_over_ae_req_per_dollar']:.2f}x requests per dollar, "
                      f"{row['pd_over_ae_goodput_per_device']:.2f}x goodput per GPU")
            out["rows"].append(row)
    out["note"] = ("each family's search simulates at most 20 candidates (goodput.max_sims), cheapest "
                   "first, stopping when no unsimulated candidate can beat the third best")
    return out


SECTIONS = {"m_trend": lambda: m_trend(), "ae_choice": lambda: ae_choice(),
            "disagg_vs_colocated": lambda: disagg_vs_colocated(),
            "heterogeneous_cost": lambda: heterogeneous_cost(),
            "pd_goodput_vs_non_pd": lambda: pd_goodput_vs_non_pd()}


def main() -> None:
    import argparse
    import json
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", choices=sorted(SECTIONS),
                    help="rerun these sections and keep the others from the existing JSON")
    a = ap.parse_args()
    path = os.path.join(RESULTS, "sim_paper_scale.json")
    res = {}
    if a.only and os.path.isfile(path):
        with open(path) as f:
            res = json.load(f)
    res.update({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
                "note": "whole-job simulator with datasheet profiles (conf/hardware); planner only proposes "
                        "plans; figures are simulated decode throughput, PD vs AE simulated goodput",
                "paper": PAPER, "workload": {"prompt": PROMPT, "output": OUTPUT, "tpot_slo_s": SLO}})
    for key, fn in SECTIONS.items():
        if not a.only or key in a.only:
            res[key] = fn()
            if a.only:
                res.setdefault("sections_dated", {})[key] = res["date"]
    write_json(path, res)


if __name__ == "__main__":
    main()
