"""The live planner inside the server, without one: the served windows a ``ServedPlanner`` builds
from the requests it is told of go to ``LivePlanner.decide``, and exactly the switches it decides
are ordered (a fake client records them), each decision kept for /planner and counted; a better
PD split is named, never ordered; the engine core hands an ``OrderReplan`` to its engine, and
the re-plan controller carries the order out at the next iteration (idle or not), once, as a
``planner`` switch."""
import asyncio
import os
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from megainfer.config import ReplanConfig
from megainfer.engine.stats import EngineLoad
from megainfer.engine_core.core import EngineCore
from megainfer.engine_core.messages import OrderReplan
from megainfer.perfmodel.plan.live_candidates import ReachableAssignments, Switchable
from megainfer.perfmodel.plan.live_planner import LivePlanner, LoadForecast, Prediction
from megainfer.runtime.replan.runner import ReplanController
from megainfer.serve.metrics import ServedRequest, ServeMetrics
from megainfer.serve.planner_child import PlannerChild
from megainfer.serve.planner_loop import ServedPlanner
from megainfer.serve.served_window import ServedWindowRecorder


class Capacities:
    """A fake simulator: each assignment serves min(rate, capacity) x its efficiency."""

    def __init__(self, plans: dict):
        self.plans = plans

    def __call__(self, load, corr, current, alone=False):
        out = []
        for name, (cap, eff) in self.plans.items():
            if alone and name != current:
                continue
            pd = name.startswith("p")
            a, e = (1, 1) if pd else (int(name[1]), int(name[3]))
            out.append(Prediction(name, 0.01, 0.01, min(load.rate, cap) * eff,
                                  headroom=load.rate / cap,
                                  deploy=dict(attention_replicas=a, attention_tp=1,
                                              expert_ranks=e, micro_batches=1,
                                              prefill_replicas=int(pd), prefill_tp=1)))
        return out


class FakeClient:
    def __init__(self):
        self.watch = SimpleNamespace(load=EngineLoad(1, 2, 0.1, 3))
        self.orders = []

    def order_replan(self, label, reason):
        self.orders.append((label, reason))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _planner(plans, **kw):
    ev = ReachableAssignments(Capacities(plans), Switchable(3, 8))
    lp = LivePlanner(ev, "a1e2m1", horizon_s=60, switch_s=1, min_gain=0.1,
                     forecast=LoadForecast(alpha=1.0, beta=1e-6), **kw)
    sp = ServedPlanner(lp, ev, 5.0, 90.0, ServeMetrics("m"))
    clock = Clock()
    sp.window = ServedWindowRecorder(90.0, clock)
    return sp, clock


def _serve(sp, clock, client, rate, dur=5.0):
    """One window of ``rate`` requests/s (prompts of 10, outputs of 4), then one step."""
    for _ in range(round(rate * dur)):
        sp.arrived(10)
        sp.finished(ServedRequest(10, 4, 0.05, 0.01))
    clock.t += dur
    return asyncio.run(sp.step(client))


def test_the_loop_orders_exactly_the_switches_the_planner_decides():
    sp, clock = _planner({"a1e2m1": (4.0, 1.0), "a2e1m1": (10.0, 1.0)}, dwell_s=12, confirm=2)
    client = FakeClient()
    got = [_serve(sp, clock, client, r) for r in (2, 2, 8, 8, 8, 8, 8, 2, 2, 2)]
    acts = [e.action for e in got]
    assert acts == [d.action for d in sp.planner.log]  # every decision kept, in order
    switches = [d for d in sp.planner.log if d.action == "switch"]
    assert client.orders == [(d.target, d.reason) for d in switches]
    assert switches[0].current == "a1e2m1" and switches[0].target == "a2e1m1"
    assert acts[:4] == ["stay", "stay", "hold", "switch"]  # confirmed on the second 8 req/s
    w = got[2].window
    assert w["arrivals"] == 40 and w["duration_s"] == 5.0 and w["waiting"] == 5
    assert w["mean_prompt_len"] == 10 and w["mean_output_len"] == 4
    assert w["ttft_p_s"] == pytest.approx(0.05) and w["tpot_p_s"] == pytest.approx(0.01)
    view = sp.view()
    assert view["current"] == sp.planner.current
    assert view["counts"]["switch"] == len(switches) and len(view["decisions"]) == len(got)
    text = generate_latest(sp.metrics.registry).decode()
    assert f'megainfer:planner_decisions_total{{model_name="m",outcome="switch"}} ' \
           f'{float(len(switches))}' in text


def test_a_better_pd_split_is_named_not_ordered():
    sp, clock = _planner({"a1e2m1": (4.0, 1.0), "a2e1m1": (4.0, 1.0),
                          "p1+a1e1m1": (20.0, 1.0)}, dwell_s=0, confirm=1)
    client = FakeClient()
    e = _serve(sp, clock, client, 8)
    assert e.action == "stay" and not client.orders
    assert e.unreachable["assignment"] == "p1+a1e1m1"
    assert "p1+a1e1m1 is predicted better" in e.reason and "not reachable online" in e.reason
    assert set(e.predicted) == {"a1e2m1", "a2e1m1"}


def test_a_failed_decision_is_shown_and_the_loop_goes_on():
    sp, clock = _planner({"a1e2m1": (4.0, 1.0)}, dwell_s=0, confirm=1)

    def boom(*a):
        raise RuntimeError("simulator broke")
    sp.planner.evaluate = boom
    e = _serve(sp, clock, FakeClient(), 2)
    assert e.action == "error" and "simulator broke" in e.reason and sp.counts["error"] == 1


def test_decisions_in_the_child_process_equal_those_on_a_thread(monkeypatch):
    """The server's planner decides in its own process (niced): the same decisions, reasons,
    predictions and orders as on a thread; a child that dies is an error entry, the loop goes
    on."""
    here = os.path.dirname(os.path.abspath(__file__))  # the child unpickles Capacities from here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    plans = {"a1e2m1": (4.0, 1.0), "a2e1m1": (10.0, 1.0), "p1+a1e1m1": (30.0, 1.0)}
    rates = (2, 2, 8, 8, 8, 8, 8, 2, 2, 2)
    (sp, clock), (sc, clock_c) = (_planner(plans, dwell_s=12, confirm=2) for _ in range(2))
    sc.decider = child = PlannerChild(sc.planner, sc.evaluate)
    try:
        assert os.getpriority(os.PRIO_PROCESS, child.proc.pid) == min(
            19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
        a, b = FakeClient(), FakeClient()
        got = [_serve(sp, clock, a, r) for r in rates]
        kids = [_serve(sc, clock_c, b, r) for r in rates]
        key = lambda e: (e.action, e.current, e.target, e.reason, e.predicted,  # noqa: E731
                         e.unreachable, e.window)
        assert [key(e) for e in kids] == [key(e) for e in got]
        assert b.orders == a.orders and a.orders  # the same switches ordered
        assert sc.view()["current"] == sp.view()["current"] != "a1e2m1"
        child.proc.kill()
        child.proc.wait()
        e = _serve(sc, clock_c, b, 2)
        assert e.action == "error" and "planner's process" in e.reason
    finally:
        child.close()
    assert child.proc.poll() is not None


class OrderTaker:
    """An ``OnlineEngine`` as far as ``EngineCore.handle`` needs for an order."""

    detokenize = stream_tokens = False
    requests: dict = {}

    def __init__(self):
        self.orders = []

    def order_replan(self, label, reason):
        self.orders.append((label, reason))


def test_the_engine_core_hands_the_order_to_its_engine():
    eng = OrderTaker()
    assert EngineCore(eng).handle(OrderReplan("a2e1m1", "why")) == []
    assert eng.orders == [("a2e1m1", "why")]


def _rank(deploy=(1, 2, 1)):
    a, e, m = deploy
    job = SimpleNamespace(replan=ReplanConfig(enabled=True, policy="planner"),
                          deploy=SimpleNamespace(attention_replicas=a, expert_ranks=e,
                                                 micro_batches=m),
                          model=SimpleNamespace(num_experts=4))
    return SimpleNamespace(job=job, replans=[], replan_decisions=[],
                           tracer=SimpleNamespace(events=[]),
                           comm=SimpleNamespace(Get_size=lambda: a + e))


def _loop(it):
    return SimpleNamespace(engine=SimpleNamespace(executor=SimpleNamespace(iteration=it),
                                                  scheduler=SimpleNamespace(running=[])),
                           router=SimpleNamespace(replicas=[]))


def test_the_controller_carries_out_a_planner_order_at_the_next_iteration():
    ctl = ReplanController(_rank())
    assert ctl.hook(_loop(1), True) is None  # nothing ordered: no measured decisions either
    ctl.order("a2e2m1", "four ranks")  # not a split of these 3 ranks: ignored
    assert ctl.planned is None
    ctl.order("a2e1m1", "the planner's numbers")
    order = ctl.hook(_loop(3), False)  # an idle iteration too
    assert (order.kind, order.old, order.new, order.iteration) == ("planner", (1, 2, 1),
                                                                   (2, 1, 1), 3)
    assert order.reason == "planner: the planner's numbers"
    assert ctl.hook(_loop(4), True) is None  # once
    ctl.order("a1e2m1", "already")
    assert ctl.hook(_loop(5), True) is None and ctl.planned is None  # the plan in place


def test_planner_config_errors_name_the_field():
    from megainfer.config import ConfigError
    with pytest.raises(ConfigError, match="replan.policy"):
        ReplanConfig(policy="oracle")
    with pytest.raises(ConfigError, match="replan.policy"):
        ReplanConfig(policy="planner", force_schedule=[[2, "a2e1"]])
    with pytest.raises(ConfigError, match="replan.planner_interval_s"):
        ReplanConfig(planner_interval_s=0)
    with pytest.raises(ConfigError, match="replan.horizon_s"):
        ReplanConfig(horizon_s=1, switch_s=2)
    with pytest.raises(ConfigError, match="replan.confirm"):
        ReplanConfig(confirm=0)
    assert ReplanConfig().measured and not ReplanConfig(policy="planner").measured
    assert not ReplanConfig(force_schedule=[[2, "a2e1"]]).measured
