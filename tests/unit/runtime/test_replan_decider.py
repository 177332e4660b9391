"""The re-planning decision on synthetic measurements (CPU, no MPI): it moves ranks towards the
side that is the bottleneck, in both directions, and stays put when the plan already fits or
the gain does not pay for the switch."""
import pytest

from megainfer.config import ConfigError, ReplanConfig
from megainfer.perfmodel.model.hardware import load_hardware
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.runtime.replan.decider import (JobState, Measurements, decide, refit,
                                              switch_cost)
from megainfer.runtime.replan.measure import comm_samples, reply_ends

SHAPE = ModelShape.from_dict(dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                                  head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=1024,
                                  vocab_size=4096), "synthetic")
HW = load_hardware("cpu_node")


def measure(k1, k1_ctx, k2, k3, k4, ctx, experts_on_rank=4, t_c=float("nan")):
    """Spans a rank would trace if its layers took exactly these times (seconds)."""
    attn = tuple((b, c, k2 + b * (k1 + k1_ctx * c)) for b in (2, 4, 8, 16) for c in (ctx, ctx + 8))
    expert = tuple((p, experts_on_rank * k4 + k3 * p) for p in (8, 16, 32, 64))
    return Measurements(attn, expert, experts_on_rank, t_c)


STATE = JobState(requests=64, context=256, output_left=256, max_seqs_per_replica=32,
                 running_per_replica=(16, 16, 16))
ATTN_HEAVY = measure(k1=2e-4, k1_ctx=4e-6, k2=2e-4, k3=2e-6, k4=5e-5, ctx=256)
EXPERT_HEAVY = measure(k1=1e-6, k1_ctx=0.0, k2=5e-5, k3=4e-4, k4=2e-3, ctx=256)


def run(meas, current, min_gain=0.10, state=STATE):
    return decide(meas, state, SHAPE, HW, 4, current, 2, min_gain, link_gbps=10.0)


def test_refit_recovers_the_synthetic_times():
    f = refit(ATTN_HEAVY, "float32")
    assert f.k1 == pytest.approx(2e-4, rel=1e-6) and f.k1_ctx == pytest.approx(4e-6, rel=1e-6)
    assert f.k3 == pytest.approx(2e-6, rel=1e-6) and f.k4 == pytest.approx(5e-5, rel=1e-6)


def test_attention_bound_moves_ranks_to_attention():
    d = run(ATTN_HEAVY, (1, 3))
    assert d.switch and d.best[0] > 1 and sum(d.best) == 4, d.describe()
    assert d.gain > 0.10 and d.cost > 0 and d.t_best + d.cost < d.t_current


def test_expert_bound_moves_ranks_to_experts():
    d = run(EXPERT_HEAVY, (3, 1))
    assert d.switch and d.best[0] < 3 and d.best[1] > 1 and sum(d.best) == 4, d.describe()


def test_steady_does_not_switch():
    best = run(ATTN_HEAVY, (1, 3)).best
    d = run(ATTN_HEAVY, best)  # already on the plan the measurements favour
    assert not d.switch and d.best == best and d.reason == "current plan is best"
    d = run(EXPERT_HEAVY, run(EXPERT_HEAVY, (3, 1)).best)
    assert not d.switch


def test_a_gain_below_min_gain_or_eaten_by_the_cost_does_not_switch():
    d = run(ATTN_HEAVY, (1, 3), min_gain=0.95)
    assert not d.switch and d.best != (1, 3) and 0 < d.gain < 0.95
    slow = decide(ATTN_HEAVY, STATE, SHAPE, HW, 4, (1, 3), 2, 0.10, link_gbps=1e-4)
    assert not slow.switch and slow.best != (1, 3) and slow.t_best < slow.t_current
    assert slow.cost > slow.t_current - slow.t_best  # the weights' move eats the gain


def test_switch_cost_counts_weights_kv_and_a_drain():
    state = JobState(8, 100, 10, 32, running_per_replica=(4, 4))
    none = switch_cost(SHAPE, (2, 2), (2, 2), state, 0.5, 1e9, "float32")
    to_e = switch_cost(SHAPE, (2, 2), (1, 3), state, 0.5, 1e9, "float32")
    to_e_more_kv = switch_cost(SHAPE, (2, 2), (1, 3), JobState(8, 100, 10, 32, (4, 8)), 0.5, 1e9,
                               "float32")
    assert none == 0 and to_e > 0.5 and to_e_more_kv > to_e
    # 4 more sequences of 100 tokens leave: their KV, every layer counted once
    kv = 4 * 100 * SHAPE.kv_bytes_per_token("float32")
    assert (to_e_more_kv - to_e) * 1e9 == pytest.approx(kv)


def test_a_slow_traced_t_c_keeps_an_expert_bound_plan():
    """Expert-bound at a3e1: with the link model's T_c (or a fast traced one) moving a rank to
    the experts pays; once the traced T_c is slower than either side's compute, both plans wait
    on the links and the switch no longer pays for itself."""
    fast = dict(k1=1e-6, k1_ctx=0.0, k2=5e-5, k3=4e-4, k4=2e-3, ctx=256)
    assert run(measure(**fast), (3, 1)).switch  # link model
    d_fast = run(measure(**fast, t_c=1e-4), (3, 1))
    d_slow = run(measure(**fast, t_c=0.1), (3, 1))
    assert d_fast.switch and d_fast.best == (2, 2), d_fast.describe()
    assert not d_slow.switch and d_slow.best == (2, 2) and d_slow.gain < d_fast.gain
    assert d_slow.t_current > 2 * d_fast.t_current  # the traced T_c is in the model's times


def test_t_c_is_read_off_rank_0_waits_and_the_expert_ranks_replies():
    def span(cat, it, layer, mb, ts, dur):
        return dict(cat=cat, ts=ts, dur=dur, args=dict(iter=it, layer=layer, mb=mb))
    rank0 = [span("E2A", 1, 0, 0, 100.0, 50.0),  # waiting from 100: last reply left at 130
             span("E2A", 1, 0, 1, 200.0, 10.0),  # started after both replies left: no sample
             span("E2A", 1, 1, 0, 300.0, 40.0),  # only one expert rank answered: no sample
             span("attention", 1, 0, 0, 0.0, 90.0)]
    e1 = reply_ends([span("E2A", 1, 0, 0, 110.0, 10.0), span("E2A", 1, 0, 1, 150.0, 5.0),
                     span("expert", 1, 0, 0, 90.0, 20.0)])
    e2 = reply_ends([span("E2A", 1, 0, 0, 125.0, 5.0), span("E2A", 1, 0, 1, 160.0, 5.0),
                     span("E2A", 1, 1, 0, 310.0, 5.0)])
    assert e1 == [(1, 0, 0, 120.0), (1, 0, 1, 155.0)]
    assert comm_samples(rank0, [e1, e2], 2) == [pytest.approx(20e-6)]


def test_the_micro_batch_count_changes_when_the_planner_prefers_another():
    """replan.micro_batches=plan: with a large fixed cost per expert call (k4), fewer
    micro-batches pay; at the best split already, only the count changes (cost: a drain)."""
    d = decide(EXPERT_HEAVY, STATE, SHAPE, HW, 4, (2, 2), 4, 0.10, vary_m=True)
    assert d.switch and d.best == (2, 2) and d.micro_batches == (4, 1), d.describe()
    assert d.label == "a2e2m1" and d.cost > 0
    held = decide(EXPERT_HEAVY, STATE, SHAPE, HW, 4, (2, 2), 4, 0.10)  # replan.micro_batches=hold
    assert not held.switch and held.label == "a2e2" and held.micro_batches == (4, 4)


def test_too_few_batch_sizes_never_switch():
    flat = Measurements(((4, 10, 1e-3),) * 3, ((8, 1e-3),) * 3, 4)
    d = run(flat, (1, 3))
    assert not d.switch and d.reason.startswith("cannot refit")


def test_config_names_bad_keys():
    with pytest.raises(ConfigError, match="replan.min_gain"):
        ReplanConfig(min_gain=-0.1)
    with pytest.raises(ConfigError, match="replan.force_schedule"):
        ReplanConfig(force_schedule=[[0, "a1e3"]])
    assert ReplanConfig(force_schedule=[[4, "a2e2"]]).force_schedule == ((4, "a2e2"),)
    assert ReplanConfig(force_schedule=[[4, "a2e2m3"]]).force_schedule == ((4, "a2e2m3"),)
    with pytest.raises(ConfigError, match="replan.force_schedule"):
        ReplanConfig(force_schedule=[[4, "a2e2m0"]])
    with pytest.raises(ConfigError, match="replan.micro_batches"):
        ReplanConfig(micro_batches="free")
