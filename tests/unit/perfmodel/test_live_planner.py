"""The live planner's loop: the forecast follows a level and a ramp, the corrections move toward
measured/predicted and stay bounded, a switch needs its gain past the switch's cost and
``min_gain``, the same winner ``confirm`` intervals running and ``dwell_s`` since the last one
(a load on the decision boundary switches at most once per dwell window), and on the
simulator's predictions the planner picks what the simulator ranks first."""
import pytest

from megainfer.config import ModelConfig
from megainfer.perfmodel.model.hardware import load_hardware
from megainfer.perfmodel.plan.auto_plan import model_shape
from megainfer.perfmodel.plan.goodput import Slo
from megainfer.perfmodel.plan.live_candidates import SimulatedAssignments, assignment_label
from megainfer.perfmodel.plan.live_planner import (Corrections, LivePlanner, Load, LoadForecast,
                                                   Prediction, ServedWindow)
from megainfer.perfmodel.plan.world_serving import ServingPins, ServingTarget, plan_world_serving
from megainfer.perfmodel.sim.events import LengthDist, poisson_requests

TINY = ModelConfig(family="mixtral", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=64,
                   max_position_embeddings=512)


def _window(t, rate, dur=10.0, prompt=100, out=50, ttft=None, tpot=None):
    return ServedWindow(t, dur, round(rate * dur), prompt, out, ttft, tpot)


def test_the_forecast_follows_a_level_and_a_ramp():
    f = LoadForecast()
    for i in range(6):
        f.observe(_window(10 * (i + 1), 5.0))
    assert f.predict(30).rate == pytest.approx(5.0)
    ramp = LoadForecast()
    for i in range(8):
        ramp.observe(_window(10 * (i + 1), 1.0 + i, prompt=100 + 10 * i))
    got = ramp.predict(20)
    assert got.rate > 8.0 and ramp.trend > 0  # ahead of the last window's 8 req/s
    assert 100 < got.prompt_len < 170
    ramp.observe(ServedWindow(90, 10, 0, 0, 0))  # nothing arrived: lengths kept, rate falls
    assert ramp.predict(0).prompt_len == got.prompt_len and ramp.predict(0).rate < got.rate
    falling = LoadForecast()
    for i, r in enumerate((9, 6, 3, 0)):
        falling.observe(_window(10 * (i + 1), r))
    assert falling.predict(60).rate == 0.0  # never below zero
    with pytest.raises(ValueError, match="alpha"):
        LoadForecast(alpha=0)
    with pytest.raises(ValueError, match="no window"):
        LoadForecast().predict(1)
    with pytest.raises(ValueError, match="duration_s"):
        ServedWindow(1, 0, 1, 1, 1)


def test_corrections_move_toward_measured_over_predicted_and_stay_bounded():
    c = Corrections()
    for _ in range(3):
        c.observe(0.2, 0.1, "ttft")
    assert c.ttft == pytest.approx(1.875) and c.tpot == 1.0
    for _ in range(20):
        c.observe(100.0, 0.1, "tpot")
    assert c.tpot == pytest.approx(5.0, rel=1e-3)
    c.observe(None, 0.1, "ttft")
    c.observe(0.1, float("inf"), "ttft")
    assert c.ttft == pytest.approx(1.875)


class Capacities:
    """A fake simulator: each assignment serves min(rate, capacity) x its efficiency."""

    def __init__(self, plans: dict):
        self.plans, self.calls = plans, []

    def __call__(self, load, corr, current, alone=False):
        self.calls.append((load, current, alone))
        return [Prediction(name, 0.01, 0.01, min(load.rate, cap) * eff,
                           headroom=load.rate / cap)
                for name, (cap, eff) in self.plans.items() if not alone or name == current]


def test_a_switch_waits_for_confirmation_and_pays_for_itself():
    ev = Capacities({"a1e3": (5.0, 1.0), "a2e2": (10.0, 0.97)})
    p = LivePlanner(ev, "a1e3", horizon_s=60, switch_s=2, min_gain=0.1, dwell_s=0, confirm=2)
    acts = [p.decide(_window(10 * (i + 1), 3.0)).action for i in range(4)]
    assert acts == ["stay"] * 4 and p.current == "a1e3"  # a1e3 serves it all, no gain
    first = p.decide(_window(50, 9.0))
    assert first.action == "hold" and "confirm=2" in first.reason
    second = p.decide(_window(60, 9.0))
    assert (second.action, second.current, second.target) == ("switch", "a1e3", "a2e2")
    assert p.current == "a2e2" and "a2e2" in second.reason and "2 s switch" in second.reason
    assert set(second.predicted) == {"a1e3", "a2e2"} and second.load.rate > 5
    assert [d.action for d in p.log] == acts + ["hold", "switch"]


@pytest.mark.parametrize("switch_s,min_gain,switches", [(2, 0.1, True), (2, 0.5, False),
                                                        (58, 0.1, False)])
def test_the_gain_must_beat_the_switch_cost_and_min_gain(switch_s, min_gain, switches):
    ev = Capacities({"a1e3": (6.0, 1.0), "a2e2": (8.0, 1.0)})  # +33% at 8 req/s
    p = LivePlanner(ev, "a1e3", horizon_s=60, switch_s=switch_s, min_gain=min_gain, dwell_s=0,
                    confirm=1)
    d = p.decide(_window(10, 8.0))
    assert (d.action == "switch") == switches, d.reason
    if not switches:
        assert "min_gain" in d.reason


def test_a_load_on_the_boundary_switches_at_most_once_per_dwell_window():
    ev = Capacities({"a1e3": (5.0, 1.0), "a2e2": (10.0, 0.9)})
    p = LivePlanner(ev, "a1e3", horizon_s=60, switch_s=1, min_gain=0.05, dwell_s=60,
                    confirm=2, forecast=LoadForecast(alpha=1.0, beta=1e-6))
    rates = [4.0, 4.0, 4.0, 7.0, 7.0, 7.0] * 10  # every 30 s the other assignment wins
    for i, r in enumerate(rates):
        p.decide(_window(5 * (i + 1), r, dur=5))
    switches = [d.at_s for d in p.log if d.action == "switch"]
    assert 2 <= len(switches) <= len(rates) * 5 / 60 + 1
    assert all(b - a >= 60 for a, b in zip(switches, switches[1:])), switches
    flip = LivePlanner(ev, "a1e3", horizon_s=60, switch_s=1, min_gain=0.05, dwell_s=0,
                       confirm=2, forecast=LoadForecast(alpha=1.0, beta=1e-6))
    for i, r in enumerate([4.0, 7.0] * 20):  # a new winner every interval: never confirmed
        flip.decide(_window(5 * (i + 1), r, dur=5))
    assert not [d for d in flip.log if d.action == "switch"]


def test_on_the_simulator_it_picks_what_the_simulator_ranks_first():
    shape, hw, slo = model_shape(TINY), load_hardware("cpu_node"), Slo(0.05, 0.012)
    pins = ServingPins(prefill_replicas=0)  # the splits a running job switches between
    ev = SimulatedAssignments(shape, hw, 4, slo, 64, 512, pins=pins, num_requests=64)
    load = Load(200.0, 256, 16)
    reqs = poisson_requests(64, load.rate, LengthDist("fixed", 256), LengthDist("fixed", 16),
                            seed=0)
    ranked = plan_world_serving(shape, hw, ServingTarget(reqs, slo, 64, 512), 4, pins)
    assert ranked[0].result.goodput_req_s > 2 * next(
        c for c in ranked if assignment_label(c) == "a2e2m2").result.goodput_req_s
    p = LivePlanner(ev, "a2e2m2", horizon_s=60, switch_s=0.5, min_gain=0.1, dwell_s=0,
                    confirm=1)
    measured_ttft = 2 * ev(load, Corrections(), "a2e2m2", alone=True)[0].ttft_p_s
    d = p.decide(ServedWindow(10, 10, 2000, 256, 16, ttft_p_s=measured_ttft))
    assert d.action == "switch" and d.target == assignment_label(ranked[0]), d.reason
    assert d.corrections[0] > 1.2 and d.corrections[1] == 1.0  # TTFT measured 2x predicted
    assert ev(load, Corrections(), d.target, alone=True)[0].deploy == dict(
        attention_replicas=ranked[0].plan.n_a, attention_tp=ranked[0].plan.tp_a,
        expert_ranks=ranked[0].plan.n_e, micro_batches=ranked[0].plan.m, prefill_replicas=0,
        prefill_tp=1)
