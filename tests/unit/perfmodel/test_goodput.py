"""Goodput planning: the goodput arithmetic, the PD composition on a case with a closed form,
SLO and trace errors naming the key or line, the no-feasible-plan message naming the bound per
family, and per-role hardware moving the choice."""
import math

import numpy as np
import pytest
from hydra import compose, initialize_config_module

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import Plan, Workload
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model, kv_transfer_s
from megainfer.perfmodel.plan.goodput import Slo, attainment, simulate_pd_composed
from megainfer.perfmodel.plan.goodput_search import GoodputSpace, Roles, search_goodput, why_bound
from megainfer.perfmodel.plan.planner import PlanError
from megainfer.perfmodel.sim.events import LengthDist, Requests, poisson_requests
from megainfer.perfmodel.sim.job import JobConfig
from perfmodel_helpers import TINY, synthetic_hw

SPACE = GoodputSpace(tp_choices=(1, 2), replica_choices=(1, 2), prefill_replicas=(1, 2),
                     micro_batches=(1, 2), max_sims=6)
REQS = poisson_requests(40, 200.0, LengthDist("fixed", 64), LengthDist("fixed", 16), seed=0)


def test_goodput_counts_requests_meeting_both_slos():
    arr = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    ttft = np.array([0.1, 0.3, 0.1, np.nan, 0.1])  # #1 misses TTFT, #3 never started
    tpot = np.array([0.01, 0.01, 0.05, np.nan, np.nan])  # #2 misses TPOT, #4 has one token
    fin = np.array([1.0, 2.0, 3.0, np.nan, 4.1])
    a = attainment(arr, ttft, tpot, fin, Slo(0.2, 0.02, 40))
    assert a.met == 2 and a.requests == 5
    assert a.goodput_req_s == pytest.approx(2 / 4.0)  # met / arrival span
    assert a.fraction == 0.4 and a.ok
    assert not attainment(arr, ttft, tpot, fin, Slo(0.2, 0.02, 50)).ok
    assert math.isinf(attainment(arr, ttft, tpot, fin, Slo(0.2, 0.02, 90)).ttft_p)  # unfinished
    batch = attainment(np.zeros(2), np.array([0.1, 0.1]), np.array([0.01, 0.01]),
                       np.array([0.5, 1.0]), Slo(1, 1, 90))
    assert batch.goodput_req_s == pytest.approx(2.0)  # all at t=0: met / makespan


@pytest.mark.parametrize("kw,key", [(dict(ttft_s=0.0, tpot_s=0.1), "slo.ttft_ms"),
                                    (dict(ttft_s=1.0, tpot_s=-1.0), "slo.tpot_ms"),
                                    (dict(ttft_s=1.0, tpot_s=float("nan")), "slo.tpot_ms"),
                                    (dict(ttft_s=1.0, tpot_s=0.1, percentile=0), "slo.percentile"),
                                    (dict(ttft_s=1.0, tpot_s=0.1, percentile=101), "slo.percentile")])
def test_impossible_slo_names_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        Slo(**kw)


def test_composed_pd_single_request_matches_the_closed_form():
    hw = synthetic_hw(mem=4e7)
    pool = PrefillPool(TINY, hw, 1, 1)
    model = decode_model(TINY, hw, hw, Workload(64, 16), "bfloat16", True, prompt_shift=64.0)
    plan = Plan(1, 1, 1, 2, 1, 1, hw.name, hw.name)
    reqs = Requests(np.array([0.5]), np.array([64]), np.array([9]))
    t = simulate_pd_composed(pool, model, plan, reqs, JobConfig(), "bfloat16")
    assert t.ttft_s[0] == pytest.approx(pool.t_prefill(64))
    kv = kv_transfer_s(TINY, np.array([64]), pool, hw, 1, "bfloat16")[0]
    # 8 decode steps of one sequence, its context growing from 65: the closed form at ctx_mean
    steps = [model.predict(Plan(1, 1, 1, 2, 1, 1, hw.name, hw.name)).t_iter]
    assert t.tpot_s[0] * 8 == pytest.approx(kv + 8 * steps[0], rel=0.05)


def _cli(*overrides):
    from megainfer.launch.plan import _run
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("plan", overrides=["plan_model@model=mixtral_8x7b", *overrides])
    return _run(cfg)


def test_malformed_trace_names_the_line(tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_text('{"arrival_s": 0, "prompt_len": 10, "output_len": 4}\n\n'
                 '{"arrival_s": 1, "prompt_len": 0, "output_len": 4}\n')
    with pytest.raises(ConfigError, match=r"trace.jsonl:3: prompt_len=0"):
        _cli(f"workload.trace={p}")


def test_bad_workload_keys_are_named():
    with pytest.raises(ConfigError, match="workload.arrival_rate"):
        _cli("workload.arrival_rate=-2")
    with pytest.raises(ConfigError, match="workload.prompt"):
        _cli("workload.arrival_rate=2", "workload.prompt.kind=gamma")
    with pytest.raises(ConfigError, match="slo.percentile"):
        _cli("workload.arrival_rate=2", "slo.percentile=0")


def test_no_feasible_plan_names_the_bound_per_family():
    hw = synthetic_hw(mem=4e7)
    with pytest.raises(PlanError) as e:  # a TPOT below one layer's kernel overhead
        search_goodput(TINY, Roles(hw, hw, hw), REQS, Slo(1e-3, 1e-6, 90), SPACE)
    msg = str(e.value)
    assert "AE plans ruled out by TPOT" in msg and "PD plans ruled out by TPOT" in msg
    assert "slo.tpot_ms=0.001" in msg
    small = synthetic_hw(mem=5e4)  # attention weights do not fit even split over tp 2
    with pytest.raises(PlanError, match="AE plans ruled out by memory"):
        search_goodput(TINY, Roles(small, small, small), REQS, Slo(1.0, 1.0, 90), SPACE)
    slow = synthetic_hw(flops=1e9, bw=1e8, mem=4e7)  # prefill of 64 tokens alone misses TTFT
    with pytest.raises(PlanError) as e:
        search_goodput(TINY, Roles(slow, hw, hw), REQS, Slo(1e-4, 1.0, 90),
                       GoodputSpace(**{**SPACE.__dict__, "families": ("PD",)}))
    assert "PD plans ruled out by TTFT" in str(e.value)


def test_best_plan_attains_and_is_explained():
    hw = synthetic_hw(mem=4e7)
    out = search_goodput(TINY, Roles(hw, hw, hw), REQS, Slo(2e-3, 0.5e-3, 90), SPACE)
    best = out.ranked[0]
    assert best.result.ok and best.result.met >= 0.9 * len(REQS)
    assert [c.per_dollar() for c in out.ranked] == sorted((c.per_dollar() for c in out.ranked),
                                                          reverse=True)
    assert 1 <= out.simulated <= SPACE.max_sims
    assert "of slo.ttft_ms" in why_bound(out, Slo(2e-3, 0.5e-3, 90))[0]


def test_heterogeneous_roles_move_the_choice():
    """Experts on cheap memory-rich devices, attention on the fast ones: the plan uses each role's
    hardware, and costs less per request than all-fast hardware meeting the same SLOs."""
    fast = synthetic_hw("fast", mem=4e7, price=4.0)
    cheap = synthetic_hw("cheap", flops=5e11, bw=5e10, mem=4e7, price=1.0)
    slo = Slo(2e-3, 0.5e-3, 90)
    homo = search_goodput(TINY, Roles(fast, fast, fast), REQS, slo, SPACE).ranked[0]
    het = search_goodput(TINY, Roles(fast, fast, cheap), REQS, slo, SPACE).ranked[0]
    assert (het.decode.hw_a, het.decode.hw_e) == ("fast", "cheap")
    assert het.per_dollar() > homo.per_dollar()
