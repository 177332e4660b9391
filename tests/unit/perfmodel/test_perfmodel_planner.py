"""Planner: every plan respects every constraint, the choice beats every enumerated plan,
heterogeneous search, and bad inputs fail naming the constraint."""
import itertools
import os
import subprocess
import sys

import pytest

from megainfer.perfmodel.model.colocated import ColocatedModel, ColocatedPlan
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.layer_times import RooflineTimes
from megainfer.perfmodel.plan.planner import (ModelTooLargeError, SearchSpace, SloUnreachableError,
                                         plan_colocated, plan_disaggregated)
from perfmodel_helpers import TINY, synthetic_hw

WL = Workload(64, 32)
SPACE = SearchSpace(tpot_slo_s=2e-3, tp_choices=(1, 2), replica_choices=(1, 2, 3),
                    micro_batches=(1, 2, 3), max_batch=4096)


def _check_constraints(ranked, hw_by_name, space):
    for r in ranked:
        p = r.pred
        plan = p.plan
        assert p.t_iter <= space.tpot_slo_s * (1 + 1e-12)
        assert p.mem_attn <= hw_by_name[plan.hw_a].mem_bytes * hw_by_name[plan.hw_a].mem_util
        assert p.mem_expert <= hw_by_name[plan.hw_e].mem_bytes * hw_by_name[plan.hw_e].mem_util
        assert plan.batch % (plan.m * plan.n_a) == 0 and plan.batch <= space.max_batch
        assert plan.m in space.micro_batches and plan.n_a in space.replica_choices
        assert TINY.num_experts % plan.n_e == 0
        assert r.binding in ("tpot_slo", "kv_memory", "max_batch")


def test_plans_respect_constraints_and_choice_is_optimal():
    hw = synthetic_hw(mem=2.5e6)
    ranked = plan_disaggregated(TINY, [hw], WL, SPACE, "bfloat16")
    _check_constraints(ranked, {hw.name: hw}, SPACE)
    # brute force: every (tp_a, tp_e, n_e, n_a, m, B) the planner enumerates, every feasible B
    model = DisaggModel(TINY, RooflineTimes(hw, TINY), RooflineTimes(hw, TINY), WL)
    cap = hw.mem_bytes * hw.mem_util
    best = 0.0
    n_feasible = 0
    for tp_a, tp_e, n_e, n_a, m in itertools.product((1, 2), (1, 2), (1, 2, 4, 8), (1, 2, 3), (1, 2, 3)):
        for k in range(1, SPACE.max_batch // (m * n_a) + 1):
            p = model.predict(Plan(tp_a, n_a, tp_e, n_e, m, k * m * n_a, hw.name, hw.name))
            if p.mem_attn > cap or p.t_iter > SPACE.tpot_slo_s:
                break  # both grow with B
            if p.mem_expert > cap:
                break
            n_feasible += 1
            best = max(best, p.tokens_per_dollar)
    assert n_feasible > 100
    assert ranked[0].pred.tokens_per_dollar >= best * (1 - 1e-12)
    assert ranked[0].pred.tokens_per_dollar == max(r.pred.tokens_per_dollar for r in ranked)


def test_binding_constraint_is_named_correctly():
    hw = synthetic_hw(mem=2.5e6)
    ranked = plan_disaggregated(TINY, [hw], WL, SPACE, "bfloat16")
    model = DisaggModel(TINY, RooflineTimes(hw, TINY), RooflineTimes(hw, TINY), WL)
    for r in ranked[:20]:
        plan = r.pred.plan
        step = plan.m * plan.n_a
        bigger = model.predict(Plan(plan.tp_a, plan.n_a, plan.tp_e, plan.n_e, plan.m, plan.batch + step,
                                    hw.name, hw.name))
        if r.binding == "tpot_slo":
            assert bigger.t_iter > SPACE.tpot_slo_s
        elif r.binding == "kv_memory":
            assert bigger.mem_attn > hw.mem_bytes * hw.mem_util


def test_heterogeneous_uses_both_profiles_and_never_loses():
    fast_mem = synthetic_hw("bwcheap", flops=2e11, bw=2e11, price=1.0, mem=3e6)
    fast_flops = synthetic_hw("flopcheap", flops=4e12, bw=3e10, price=1.0, mem=3e6)
    het = plan_disaggregated(TINY, [fast_mem, fast_flops], WL, SPACE, "bfloat16", heterogeneous=True)
    _check_constraints(het, {h.name: h for h in (fast_mem, fast_flops)}, SPACE)
    pairs = {(r.pred.plan.hw_a, r.pred.plan.hw_e) for r in het}
    assert ("bwcheap", "flopcheap") in pairs and ("flopcheap", "bwcheap") in pairs
    homo = plan_disaggregated(TINY, [fast_mem, fast_flops], WL, SPACE, "bfloat16", heterogeneous=False)
    assert het[0].pred.tokens_per_dollar >= homo[0].pred.tokens_per_dollar
    # attention (memory-bound) goes to the bandwidth-cheap part, experts to the FLOP-cheap part
    assert (het[0].pred.plan.hw_a, het[0].pred.plan.hw_e) == ("bwcheap", "flopcheap")


def test_colocated_plans_respect_constraints():
    hw = synthetic_hw(mem=2.5e6)
    ranked = plan_colocated(TINY, hw, WL, SPACE, "bfloat16")
    model = ColocatedModel(TINY, RooflineTimes(hw, TINY), WL)
    for r in ranked:
        p = r.pred
        assert p.t_iter <= SPACE.tpot_slo_s and p.mem <= hw.mem_bytes
        worse = model.predict(ColocatedPlan(p.plan.group, p.plan.m, p.plan.batch + p.plan.m, hw.name))
        assert worse.t_iter > SPACE.tpot_slo_s or worse.mem > hw.mem_bytes or \
            p.plan.batch + p.plan.m > SPACE.max_batch


def test_slo_unreachable_names_the_slo():
    hw = synthetic_hw(mem=2.5e6)
    space = SearchSpace(tpot_slo_s=1e-6, tp_choices=(1,), replica_choices=(1,), micro_batches=(1, 2))
    with pytest.raises(SloUnreachableError, match=r"slo.tpot_ms=0.001: unreachable.*needs .* ms per token"):
        plan_disaggregated(TINY, [hw], WL, space)


def test_model_too_large_names_memory():
    hw = synthetic_hw(mem=5e4)  # 50 KB: not even one expert split over tp_e=2 fits
    with pytest.raises(ModelTooLargeError, match=r"memory: model too large.*expert weights need .* GiB"):
        plan_disaggregated(TINY, [hw], WL, SPACE)
    hw2 = synthetic_hw(mem=2.0e5)  # experts fit when spread; attention weights + KV do not
    with pytest.raises(ModelTooLargeError, match="attention weights \\+ KV"):
        plan_disaggregated(TINY, [hw2], WL, SearchSpace(tpot_slo_s=1.0, tp_choices=(1,),
                                                         replica_choices=(1,), micro_batches=(1,)))


def test_cli_plan_table_png_and_bad_input(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "megainfer-plan")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    r = subprocess.run([exe, "model=mixtral_8x7b", "hardware=h100", "slo.tpot_ms=80",
                        "search.replica_choices=[1,2,4]", "search.tp_choices=[1,2]",
                        f"out.dir={tmp_path}", "top=3"], capture_output=True, text=True,
                       timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    assert "T_a ms" in r.stdout and "binding" in r.stdout and "mixtral_8x7b" in r.stdout
    assert "disaggregated / colocated" in r.stdout
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "plans.json").is_file()
    bad = subprocess.run([exe, "model=mixtral_8x22b", "hardware=l40s", "slo.tpot_ms=0.01",
                          f"out.dir={tmp_path}"], capture_output=True, text=True, timeout=240, env=env)
    assert bad.returncode == 2
    assert "slo.tpot_ms=0.01: unreachable" in bad.stderr
