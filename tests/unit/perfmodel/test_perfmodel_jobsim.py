"""Whole-job simulator (perfmodel/sim/job.py, perfmodel/sim/events.py) on cases with a closed-form
answer: a fixed balanced batch reproduces DisaggModel.predict, one request's TTFT / TPOT are the
formula's prefill / decode iterations, skew scales the expert stage by the max-load factor,
arrivals queue only above capacity, links shared by concurrent messages, and speed at 256 ranks."""
import json
import os
import time

import numpy as np
import pytest
import yaml

import megainfer.conf
from megainfer.config import ConfigError
from megainfer.perfmodel.sim.events import (LengthDist, Requests, Routing, draw_counts, fair_share,
                                        makespan, makespan_outer, poisson_requests,
                                        read_request_trace)
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.hardware import load_hardware
from megainfer.perfmodel.model.layer_times import RooflineTimes, layer_times_for
from megainfer.perfmodel.model.pipeline import t_total
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.sim.job import JobConfig, Pipeline, expert_times, simulate_job
from megainfer.perfmodel.trace import LANES, read_trace
from perfmodel_helpers import TINY, synthetic_hw


def _shape(name):
    with open(os.path.join(os.path.dirname(megainfer.conf.__file__), "plan_model", f"{name}.yaml")) as f:
        d = yaml.safe_load(f)
    return ModelShape.from_dict({k: v for k, v in d.items() if k != "name"}, d.get("name", name))


def _model(wl=Workload(64, 32), **hw_kw):
    hw = synthetic_hw(**hw_kw)
    return DisaggModel(TINY, RooflineTimes(hw, TINY), RooflineTimes(hw, TINY), wl)


def _fixed_iteration(model, plan, ctx=None):
    s = model.shape
    b_a = plan.batch / (plan.m * plan.n_a)
    tok = np.full((plan.n_a, plan.m), b_a)
    c = np.full_like(tok, model.wl.ctx_mean if ctx is None else ctx)
    counts = draw_counts(None, tok.sum(axis=0), s.top_k, s.num_experts, s.num_layers, None)
    return Pipeline(model, plan).iteration(0.0, tok, c, tok, counts)


@pytest.mark.parametrize("plan", [Plan(1, 1, 1, 2, 1, 4), Plan(1, 2, 1, 4, 2, 16), Plan(2, 3, 1, 8, 3, 36),
                                  Plan(1, 2, 2, 4, 4, 64), Plan(1, 4, 1, 1, 2, 8)])
def test_fixed_batch_reproduces_closed_form(plan):
    for model in (_model(), _model(link_bw=1e7, latency=5e-5)):  # compute- and link-bound
        assert _fixed_iteration(model, plan) == pytest.approx(model.predict(plan).t_iter, rel=1e-9)


def test_fixed_batch_calibrated_profile_with_node_terms():
    """FittedTimes (k1..k4) and a shared CPU node (hop overhead, dilation, wake-up latency)."""
    hw, shape = load_hardware("cpu_node"), _shape("cpu_small")
    times = layer_times_for(hw, shape)
    model = DisaggModel(shape, times, times, Workload(64, 32))
    for plan in (Plan(1, 1, 1, 2, 1, 8), Plan(1, 2, 1, 2, 2, 16)):
        assert _fixed_iteration(model, plan) == pytest.approx(model.predict(plan).t_iter, rel=1e-9)


def test_node_terms_follow_each_iterations_own_stage_times():
    """On a shared CPU node the cores an iteration's ranks share depend on how long each side
    computes in it: a prefill chunk's attention (hundreds of tokens per micro-batch) overlaps
    the experts for a smaller share of its time than a decode step's does. Each iteration takes
    ``DisaggModel.node_terms`` at its own mean stage times, not the plan's balanced decode load."""
    hw, shape = load_hardware("cpu_node"), _shape("cpu_small")
    times = layer_times_for(hw, shape)
    model = DisaggModel(shape, times, times, Workload(64, 32))
    plan = Plan(1, 1, 1, 2, 2, 8)  # A1 + E2 on 2 cores, m = 2
    pipe = Pipeline(model, plan)
    tok = np.array([[256.0, 256.0]])  # one 512-token prefill chunk in two micro-batches
    ctx = np.array([[128.5, 384.5]])
    counts = draw_counts(None, tok.sum(axis=0), shape.top_k, shape.num_experts, shape.num_layers, None)
    ta = np.array([[times.t_attn(b, c) for b, c in zip(tok[0], ctx[0])]])
    te = expert_times(times, counts.reshape(shape.num_layers, 2, 2, -1), 1)
    got = pipe.node_terms(ta, te)
    assert got == pytest.approx(model.node_terms(plan, float(ta.mean()), float(te.mean())), rel=1e-12)
    balanced = model.plan_node_terms(plan)
    assert got[2] < balanced[2] - 0.05  # attention overlaps the experts for less of its time
    # the iteration is priced with these terms: slower experts, faster attention than before
    assert got[3] > balanced[3]
    # an empty side keeps the plan's terms
    assert pipe.node_terms(np.zeros((1, 2)), te) == balanced
    fixed = Pipeline(model, plan)
    fixed.node_terms = lambda ta, te: balanced  # the rule before: the plan's terms everywhere
    rows = np.zeros_like(tok)
    assert abs(pipe.iteration(0.0, tok, ctx, rows, counts) / fixed.iteration(0.0, tok, ctx, rows, counts) - 1) > 0.02


def test_vectorised_expert_times_equal_scalar():
    rng = np.random.default_rng(0)
    hw = load_hardware("cpu_node")
    for times in (RooflineTimes(synthetic_hw(), TINY), layer_times_for(hw, _shape("cpu_small"))):
        counts = rng.integers(0, 5, size=(20, 4)).astype(float)
        for tp in (1, 2):
            want = [times.t_expert(list(c), tp) for c in counts]
            assert expert_times(times, counts, tp) == pytest.approx(want, rel=1e-12)


def test_whole_job_fixed_batch_tpot_equals_formula():
    """B requests at t = 0, prompt P, output O: one prefill iteration, then O - 1 decode iterations
    whose mean context is the closed form's P + O/2 -> TPOT = predict(plan).t_iter (m = 1)."""
    P, O, B = 64, 33, 8
    model = _model(Workload(P, O))  # ctx_mean = P + O/2 = the decode iterations' mean context
    plan = Plan(1, 2, 1, 4, 1, B)
    req = Requests(np.zeros(B), np.full(B, P), np.full(B, O))
    r = simulate_job(model, plan, req, JobConfig(max_num_batched_tokens=4096))
    assert len(r.iteration_s) == O
    assert r.tpot_s == pytest.approx(np.full(B, model.predict(plan).t_iter), rel=1e-9)


def _prefill_time(model, plan, P):
    """The formula's one-iteration prefill of a lone P-token prompt (m = 1): T_a at the chunk's
    mean context (P + 1) / 2, T_e of P * K / E tokens per expert, T_c at that load, + lm_head."""
    s = model.shape
    b_e = P * s.top_k / s.num_experts
    t_a = model.ta.t_attn(P, (P + 1) / 2, plan.tp_a)
    t_e = model.te.t_expert([b_e] * model.experts_per_rank(plan.n_e), plan.tp_e)
    return t_total(t_a, t_e, model.t_comm(P, b_e, plan), 1, s.num_layers) + model.ta.t_head(1)


def test_single_request_ttft_and_tpot():
    P, O = 100, 21
    model = _model(Workload(P, O))
    plan = Plan(1, 1, 1, 2, 1, 1)
    r = simulate_job(model, plan, Requests(np.array([0.5]), np.array([P]), np.array([O])), JobConfig())
    assert r.ttft_s[0] == pytest.approx(_prefill_time(model, plan, P), rel=1e-9)
    assert r.tpot_s[0] == pytest.approx(model.predict(plan).t_iter, rel=1e-9)
    assert r.latency_s[0] == pytest.approx(r.ttft_s[0] + (O - 1) * r.tpot_s[0], rel=1e-9)
    # chunked prefill: a 100-token prompt under a 32-token budget takes 4 iterations
    r4 = simulate_job(model, plan, Requests(np.array([0.0]), np.array([P]), np.array([O])),
                      JobConfig(max_num_batched_tokens=32))
    assert len(r4.iteration_s) == 4 + O - 1 and r4.ttft_s[0] > r.ttft_s[0]


def test_skew_scales_expert_stage_by_max_load_factor():
    """Compute-bound experts, free links: all slots on experts 0 and 1 (both on expert rank 0 of
    4) makes rank 0 carry 4x the balanced load, so each layer's expert stage takes 4x."""
    model = _model(flops=1e9, overhead=0.0, latency=0.0, link_bw=1e18)
    plan = Plan(1, 1, 1, 4, 1, 16)
    req = Requests(np.zeros(16), np.full(16, 8), np.full(16, 2))
    L, s = TINY.num_layers, TINY
    bal = simulate_job(model, plan, req, JobConfig())
    hot = simulate_job(model, plan, req, JobConfig(routing=Routing("load", load=(1, 1, 0, 0, 0, 0, 0, 0))))
    t_a = model.ta.t_attn(16, 8 + 1)  # the decode iteration (ctx = 9), its head over 16 rows
    t_e = model.te.t_expert([16 * s.top_k / s.num_experts] * 2)
    head = model.ta.t_head(16)
    d_bal, d_hot = bal.iteration_s[1][1], hot.iteration_s[1][1]
    assert d_bal == pytest.approx(L * (t_a + t_e) + head, rel=1e-9)
    assert (d_hot - L * t_a - head) / (d_bal - L * t_a - head) == pytest.approx(4.0, rel=1e-9)
    # Zipf sits between: slower than balanced, at most the all-on-one-rank case
    z = simulate_job(model, plan, req, JobConfig(routing=Routing("zipf", 1.2), seed=3))
    assert d_bal < z.iteration_s[1][1] <= d_hot * (1 + 1e-9)


def test_arrivals_low_rate_no_queueing_high_rate_queues():
    P, O = 64, 8
    model = _model(Workload(P, O))
    plan = Plan(1, 1, 1, 2, 1, 1)
    t_pre = _prefill_time(model, plan, P)
    lone = simulate_job(model, plan, Requests(np.zeros(1), np.array([P]), np.array([O])), JobConfig())
    rate_low = 0.01 / lone.latency_s[0]
    low = simulate_job(model, plan, poisson_requests(40, rate_low, LengthDist("fixed", P),
                                                     LengthDist("fixed", O), seed=1), JobConfig())
    assert low.ttft_s == pytest.approx(np.full(40, t_pre), rel=1e-9)
    # capacity: 2 sequences in flight, each ~ latency -> about 2 / latency requests/s; send 20x that
    cfg = JobConfig(max_num_seqs=2)
    high = simulate_job(model, plan, poisson_requests(200, 40 / lone.latency_s[0], LengthDist("fixed", P),
                                                      LengthDist("fixed", O), seed=1), cfg)
    ttft = high.ttft_s
    assert np.percentile(ttft, 90) > 20 * t_pre
    assert ttft[-50:].mean() > 5 * ttft[:50].mean()  # queueing grows over the job
    assert high.throughput_req_s < 2.5 / lone.latency_s[0]


def test_link_contention_two_messages_take_twice_as_long():
    one = fair_share([0.0], [1e6], 1e9)
    two = fair_share([0.0, 0.0], [1e6, 1e6], 1e9)
    assert one[0] == pytest.approx(1e-3) and two == pytest.approx([2e-3, 2e-3])
    late = fair_share([0.0, 0.5e-3], [1e6, 1e6], 1e9, latency=1e-6)  # shares once the 2nd starts
    assert late == pytest.approx([1.5e-3 + 1e-6, 2e-3 + 1e-6])
    rng = np.random.default_rng(0)
    for _ in range(20):  # a work-conserving link's makespan: the same for fair share and FIFO
        st, sz = rng.uniform(0, 1e-3, 6), rng.uniform(0, 1e6, 6)
        got = makespan(st[None], sz[None], np.array([1e9]))[0]
        assert got == pytest.approx(fair_share(st, sz, 1e9).max())
        w, free = rng.uniform(0, 1, 6), rng.uniform(0, 1e-3, 3)
        want = makespan(np.maximum(st[None], free[:, None]), np.tile(w, (3, 1)), np.full(3, 1.0 / 7e-4))
        assert makespan_outer(st, w, free, np.full(3, 7e-4)) == pytest.approx(want)
    # in the pipeline: twice the replicas sending to one expert rank over a slow link -> the
    # receiver's ingress carries twice the bytes and the A2E / E2A stage takes twice as long
    model = _model(latency=0.0, link_bw=1e6)
    t1 = model.t_comm(4, 4 * 2 / 8, Plan(1, 1, 1, 1, 1, 4))
    t2 = model.t_comm(4, 8 * 2 / 8, Plan(1, 2, 1, 1, 1, 8))
    assert t2 == pytest.approx(2 * t1)
    assert _fixed_iteration(model, Plan(1, 2, 1, 1, 1, 8)) == pytest.approx(
        model.predict(Plan(1, 2, 1, 1, 1, 8)).t_iter, rel=1e-9)


def test_256_ranks_in_seconds():
    shape, hw = _shape("deepseek_v3"), load_hardware("h800")
    model = DisaggModel(shape, RooflineTimes(hw, shape), RooflineTimes(hw, shape), Workload(256, 32))
    plan = Plan(1, 128, 1, 128, 3, 128 * 48)
    req = poisson_requests(128 * 48, 0, LengthDist("fixed", 256), LengthDist("fixed", 32))
    t = time.process_time()  # this process's CPU time: other load on a shared host is not in it
    r = simulate_job(model, plan, req, JobConfig(max_num_seqs=48, max_num_batched_tokens=4096,
                                                 routing=Routing("zipf", 0.8)))
    # ~1 s when idle; the bound catches a per-rank or per-token Python loop (tens of seconds)
    assert time.process_time() - t < 10.0
    assert r.summary()["finished"] == len(req)


def test_request_trace_file_and_malformed_lines(tmp_path):
    good = tmp_path / "w.jsonl"
    good.write_text('{"arrival_s": 0.2, "prompt_len": 16, "output_len": 4}\n\n'
                    '{"arrival_s": 0.0, "prompt_len": 8, "output_len": 1}\n')
    req = read_request_trace(str(good))
    assert list(req.arrival_s) == [0.0, 0.2] and list(req.prompt_len) == [8, 16]
    r = simulate_job(_model(), Plan(1, 1, 1, 2, 1, 1), req, JobConfig())
    assert r.summary()["finished"] == 2 and np.isnan(r.tpot_s[0])
    for body, line, what in (('{"arrival_s": 0, "prompt_len": 8, "output_len": 2}\n{oops\n', 2, ""),
                             ('{"arrival_s": 0, "prompt_len": 8}\n', 1, "output_len"),
                             ('\n{"arrival_s": -1, "prompt_len": 8, "output_len": 2}\n', 2, "arrival_s"),
                             ('{"arrival_s": 0, "prompt_len": 2.5, "output_len": 2}\n', 1, "prompt_len"),
                             ('[1, 2]\n', 1, "object")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(ConfigError, match=f"bad.jsonl:{line}: .*{what}"):
            read_request_trace(str(bad))


def test_bad_config_named():
    with pytest.raises(ConfigError, match="routing.kind"):
        Routing("hot")
    with pytest.raises(ConfigError, match="length.kind"):
        LengthDist("normal")
    with pytest.raises(ConfigError, match="job.max_num_seqs"):
        JobConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="routing.load shape"):
        simulate_job(_model(), Plan(1, 1, 1, 2, 1, 1), Requests(np.zeros(1), np.array([4]), np.array([2])),
                     JobConfig(routing=Routing("load", load=(1, 2, 3))))


def test_length_distributions():
    rng = np.random.default_rng(0)
    u = LengthDist("uniform", lo=3, hi=5).sample(rng, 1000)
    assert u.min() == 3 and u.max() == 5
    ln = LengthDist("lognormal", value=100, sigma=0.5, hi=400).sample(rng, 5000)
    assert 90 < np.median(ln) < 110 and ln.max() <= 400 and ln.min() >= 1


def test_writes_runtime_trace_format(tmp_path):
    model = _model()
    plan = Plan(1, 2, 1, 4, 2, 8)
    req = Requests(np.zeros(8), np.full(8, 8), np.full(8, 3))
    r = simulate_job(model, plan, req, JobConfig(trace_iterations=2))
    path = tmp_path / "t.json"
    r.trace.write(str(path), plan={"n_a": 2})
    tr = read_trace(str(path))
    assert {e["cat"] for e in tr["events"]} == set(LANES["disaggregated"])
    assert {e["args"]["iter"] for e in tr["events"]} == {0, 1}
    assert len(tr["names"]) == plan.n_a + plan.n_e
    json.loads(path.read_text())
