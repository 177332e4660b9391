"""What the goodput planner's job simulator predicts for one served deploy plan and workload
(``megainfer-plan workload.arrival_rate=R slo.ttft_ms=.. slo.tpot_ms=..``'s simulation, for
the plan the server runs instead of the plans the search would pick): TTFT / TPOT p50 and p99,
the SLO-percentile figures and goodput.

An AE plan (attention replicas and expert ranks, prefill chunked into the decode batches) goes
through ``plan.goodput.simulate_ae``; a PD plan (prefill ranks before the decode pool) through
``plan.goodput.simulate_pd``, exactly as ``plan.goodput_search`` simulates its candidates.
Single mode is no plan of either family: no prediction (None). The hardware profile is this
machine's calibrated one, else the ``cpu_node`` preset
(``perfmodel.plan.auto_plan.hardware_for``), recorded beside the figures.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from megainfer.config import DeployPlan
from megainfer.perfmodel.plan.auto_plan import hardware_for
from megainfer.perfmodel.model.disagg import Plan, Workload
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.plan.goodput import Slo, attainment, simulate_ae, simulate_pd
from megainfer.perfmodel.sim.events import LengthDist, Requests, poisson_requests
from megainfer.perfmodel.sim.job import JobConfig


def _ms(x: np.ndarray, q: float) -> Optional[float]:
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q) * 1e3) if len(x) else None


def predict(shape: ModelShape, deploy: DeployPlan, rate: float, num_requests: int,
            input_len: int, output_len: int, slo: Slo, max_num_seqs: int,
            max_num_batched_tokens: int, dtype: str, device: str = "cpu",
            seed: int = 0) -> Optional[dict]:
    """``rate``: requests/s (inf: all at once). None for single mode."""
    if deploy.mode != "disaggregated":
        return None
    hw, source = hardware_for(None, device)
    reqs: Requests = poisson_requests(num_requests, rate if math.isfinite(rate) else 0.0,
                                      LengthDist(value=input_len), LengthDist(value=output_len),
                                      seed)
    n_a, n_e = deploy.attention_replicas, deploy.expert_ranks
    plan = Plan(deploy.attention_tp, n_a, 1, n_e, deploy.micro_batches, max_num_seqs * n_a,
                hw.name, hw.name)
    model = decode_model(shape, hw, hw, Workload(input_len, output_len), dtype, True)
    cfg = JobConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    seed=seed, max_iterations=200_000)
    if deploy.prefill_replicas:
        pool = PrefillPool(shape, hw, deploy.prefill_replicas, deploy.prefill_tp, dtype, True)
        t = simulate_pd(pool, model, plan, reqs, cfg, dtype)
        family = f"PD p{deploy.prefill_replicas} -> {plan.label()} m={plan.m}"
    else:
        t = simulate_ae(model, plan, reqs, cfg)
        family = f"AE {plan.label()} m={plan.m}"
    a = attainment(t.arrival_s, t.ttft_s, t.tpot_s, t.finish_s, slo)
    span = float(np.nanmax(t.finish_s) - t.arrival_s.min())  # the benchmark's duration
    return {"plan": family, "hardware": f"{hw.name} ({source})",
            "p50_ttft_ms": _ms(t.ttft_s, 50), "p99_ttft_ms": _ms(t.ttft_s, 99),
            "p50_tpot_ms": _ms(t.tpot_s, 50), "p99_tpot_ms": _ms(t.tpot_s, 99),
            "request_goodput": a.met / span if span > 0 else None,  # as the benchmark's
            "planner_goodput": a.goodput_req_s,  # met / arrival span (the planner's definition)
            "slo_attained_fraction": a.fraction,
            "slo_percentile": slo.percentile}
