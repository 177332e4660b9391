"""Simulator: equals T_total exactly with zero jitter and balanced load; jitter and imbalance
only slow it down; the trace follows docs/trace_format.md; plot_trace draws it."""
import json
import os
import random

import numpy as np
import pytest

from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.layer_times import RooflineTimes
from megainfer.perfmodel.model.pipeline import comm_hidden, t_total, t_total_design
from megainfer.perfmodel.sim.fixed_batch import SimConfig, simulate, simulate_plan
from megainfer.perfmodel.timeline_plot import plot_trace
from megainfer.perfmodel.trace import LANES, read_trace
from perfmodel_helpers import TINY, synthetic_hw


def _sim(ta, te, tc, m, layers, n_a=2, n_e=4, **kw):
    cfg = SimConfig(n_a=n_a, n_e=n_e, m=m, layers=layers, b_a=4, num_experts=8, top_k=2, **kw)
    return simulate(cfg, lambda b: ta, lambda c: te, tc, trace=False)


def test_sim_equals_t_total_every_regime():
    rng = random.Random(0)
    hidden = 0
    for _ in range(60):
        ta, te = rng.uniform(0.1, 2.0), rng.uniform(0.1, 2.0)
        tc = rng.choice([0.0, rng.uniform(0, 0.5), rng.uniform(0.5, 3.0)])
        m, layers = rng.randint(1, 4), rng.randint(1, 5)
        res = _sim(ta, te, tc, m, layers, n_a=rng.randint(1, 3), n_e=rng.choice([1, 2, 8]))
        assert res.iteration_s[0] == pytest.approx(t_total(ta, te, tc, m, layers), rel=1e-12)
        if comm_hidden(ta, te, tc, m):
            hidden += 1
            assert res.iteration_s[0] == pytest.approx(t_total_design(ta, te, tc, m, layers), rel=1e-12)
    assert hidden >= 10


def test_simulate_plan_matches_model_prediction():
    hw = synthetic_hw()
    model = DisaggModel(TINY, RooflineTimes(hw, TINY), RooflineTimes(hw, TINY), Workload(64, 32))
    plan = Plan(tp_a=2, n_a=2, tp_e=1, n_e=4, m=3, batch=48, hw_a=hw.name, hw_e=hw.name)
    pred = model.predict(plan)
    res = simulate_plan(model, plan, iterations=2)
    assert res.iteration_s == pytest.approx([pred.t_total] * 2, rel=1e-12)


def test_jitter_and_imbalance_only_slow_it_down():
    base = _sim(1.0, 1.0, 0.2, 3, 4).iteration_s[0]
    jit = simulate(SimConfig(n_a=4, n_e=4, m=3, layers=4, b_a=4, num_experts=8, top_k=2,
                             jitter_s=0.3, iterations=5, seed=1),
                   lambda b: 1.0, lambda c: 1.0, 0.2, trace=False)
    assert min(jit.iteration_s) > base
    te = lambda c: 0.1 + 0.05 * float(np.sum(c))  # noqa: E731
    bal = simulate(SimConfig(n_a=2, n_e=4, m=2, layers=3, b_a=16, num_experts=8, top_k=2),
                   lambda b: 1.0, te, 0.1, trace=False)
    skew = simulate(SimConfig(n_a=2, n_e=4, m=2, layers=3, b_a=16, num_experts=8, top_k=2,
                              routing="zipf", skew=1.2, iterations=3, seed=3),
                    lambda b: 1.0, te, 0.1, trace=False)
    assert min(skew.iteration_s) > bal.iteration_s[0]
    assert sum(skew.expert_busy) / 3 == pytest.approx(sum(bal.expert_busy), rel=0.2)


def test_trace_format_and_dependencies(tmp_path):
    res = simulate(SimConfig(n_a=2, n_e=2, m=2, layers=2, b_a=3, num_experts=4, top_k=2, tp_a=2),
                   lambda b: 1e-3, lambda c: 2e-3, 5e-4)
    path = tmp_path / "trace.json"
    res.trace.write(str(path), plan={"m": 2})
    d = json.loads(path.read_text())
    assert d["displayTimeUnit"] == "ms" and d["metadata"]["source"] == "simulator"
    assert d["metadata"]["mode"] == "disaggregated" and d["metadata"]["plan"] == {"m": 2}
    names = {e["pid"]: e["args"]["name"] for e in d["traceEvents"] if e.get("name") == "process_name"}
    assert names[0] == "[attn dp0 tp0]" and names[3] == "[attn dp1 tp1]" and names[4] == "[expert 0]"
    xs = [e for e in d["traceEvents"] if e["ph"] == "X"]
    lanes = LANES["disaggregated"]
    for e in xs:
        assert set(e) >= {"name", "cat", "pid", "tid", "ts", "dur", "args"}
        assert lanes[e["tid"]] == e["cat"] and set(e["args"]) == {"iter", "layer", "mb", "tokens"}
        assert (e["pid"] < 4) == (e["cat"] in ("attention", "A2E"))
    assert len(xs) == 2 * 2 * (4 * 2 + 2 * 2)  # layers * mbs * (attn ranks * 2 lanes + experts * 2)
    # no lane overlaps, and attention (mb, l+1) starts after E2A (mb, l) ends
    by_lane = {}
    for e in xs:
        by_lane.setdefault((e["pid"], e["tid"]), []).append(e)
    for evs in by_lane.values():
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:]):
            if a["cat"] in ("attention", "expert"):
                assert b["ts"] >= a["ts"] + a["dur"] - 1e-6
    e2a_end = max(e["ts"] + e["dur"] for e in xs if e["cat"] == "E2A" and e["args"]["mb"] == 1
                  and e["args"]["layer"] == 0)
    attn_l1 = min(e["ts"] for e in xs if e["cat"] == "attention" and e["args"]["mb"] == 1
                  and e["args"]["layer"] == 1)
    assert attn_l1 >= e2a_end - 1e-6
    assert res.iteration_s[0] * 1e6 == pytest.approx(max(e["ts"] + e["dur"] for e in xs), rel=1e-6)
    png = tmp_path / "t.png"
    n = plot_trace(read_trace(str(path)), str(png), max_layer=1)
    assert n == len([e for e in xs if e["args"]["layer"] < 1]) and png.stat().st_size > 5000


def test_megainfer_timeline_draws_a_steady_iteration(tmp_path, monkeypatch):
    import subprocess
    import sys

    from megainfer.perfmodel.trace import TraceWriter
    from megainfer.tools.timeline import PlotExtraMissing, draw_timeline, steady_iteration
    w = TraceWriter()
    w.name_ranks(1, 1, 1, 1)
    for it, start, span in [(0, 0.0, 5.0), (1, 5.0, 1.2), (2, 6.2, 0.9), (3, 7.1, 1.0),
                            (4, 8.1, 1.1)]:  # iteration 0: the start-up wait
        for lane, pid, a, b in [("attention", 0, 0.0, 0.3), ("A2E", 0, 0.3, 0.4),
                                ("expert", 1, 0.4, 0.7), ("E2A", 0, 0.4, 1.0)]:
            w.span(pid, lane, start + a * span, start + b * span, it, 0, 0, 4)
    path = tmp_path / "trace.json"
    w.write(str(path))
    assert steady_iteration(read_trace(str(path))) == 3  # the median span of iterations 1..4
    exe = os.path.join(os.path.dirname(sys.executable), "megainfer-timeline")
    r = subprocess.run([exe, str(path), "-o", str(tmp_path / "x.png"), "--iter", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "drew 4 events of iteration 2" in r.stdout, r.stderr
    assert (tmp_path / "x.png").stat().st_size > 5000
    assert draw_timeline(str(path), str(tmp_path / "y.png")) == (3, 4)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    with pytest.raises(PlotExtraMissing, match=r"pip install 'megainfer\[plot\]'"):
        draw_timeline(str(path), str(tmp_path / "z.png"))
