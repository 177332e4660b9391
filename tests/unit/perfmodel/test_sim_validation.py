"""The job simulator against its closed-form baseline (perfmodel/sim/closed_form.py), the colocated
job simulator (perfmodel/sim/job_colocated.py), and the runtime job that releases requests at
their arrival times (perf/jobs/workload_job.py, real mpiexec) which perf/validate/validate_sim.py measures.

Where nothing but the fixed batch matters the simulator equals the closed form; skew and arrivals
move it in the expected direction."""
import json

import numpy as np
import pytest

from megainfer.bench.sim_validation import measured_summary
from megainfer.perfmodel.model.colocated import ColocatedModel, ColocatedPlan
from megainfer.perfmodel.sim.events import LengthDist, Requests, Routing, draw_counts, poisson_requests
from megainfer.perfmodel.sim.closed_form import closed_form_job
from megainfer.perfmodel.sim.job import JobConfig, simulate_job
from megainfer.perfmodel.sim.job_colocated import ColocatedPipeline, simulate_colocated_job
from megainfer.perfmodel.model.layer_times import RooflineTimes
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from mpi_util import run_mpi
from perf_util import perf_script
from perfmodel_helpers import TINY, synthetic_hw

P, O = 32, 9
BIG = JobConfig(max_num_seqs=1024, max_num_batched_tokens=1 << 16)


def _model(**kw):
    hw = synthetic_hw(**kw)
    return DisaggModel(TINY, RooflineTimes(hw, TINY), RooflineTimes(hw, TINY), Workload(P, O))


def _offline(n):
    return Requests(np.zeros(n), np.full(n, P), np.full(n, O))


@pytest.mark.parametrize("plan", [Plan(1, 1, 1, 2, 1, 16), Plan(1, 2, 1, 4, 2, 16), Plan(2, 2, 1, 8, 1, 32)])
def test_offline_balanced_job_equals_closed_form(plan):
    """B requests at t = 0, one prefill pass (budget >= B * P), balanced routing: TTFT, TPOT and
    throughput of the simulated job are the closed form's, to rounding."""
    model = _model()
    cf = closed_form_job(model, plan, _offline(plan.batch))
    sim = simulate_job(model, plan, _offline(plan.batch), BIG).summary()
    for k in ("ttft_s_p50", "tpot_s_p50", "throughput_tok_s"):
        assert sim[k] == pytest.approx(cf[k], rel=1e-9), k
    # host work per iteration: every iteration that much longer, in both
    x = 0.3 * cf["tpot_s_p50"]
    cfx = closed_form_job(model, plan, _offline(plan.batch), iteration_overhead_s=x)
    simx = simulate_job(model, plan, _offline(plan.batch), JobConfig(
        max_num_seqs=1024, max_num_batched_tokens=1 << 16, iteration_overhead_s=x)).summary()
    assert simx["tpot_s_p50"] == pytest.approx(sim["tpot_s_p50"] + x, rel=1e-9)
    for k in ("ttft_s_p50", "tpot_s_p50", "throughput_tok_s"):
        assert simx[k] == pytest.approx(cfx[k], rel=1e-9), k


def test_skew_is_slower_than_closed_form():
    model, plan = _model(flops=1e9, link_bw=1e18), Plan(1, 1, 1, 4, 1, 16)
    cf = closed_form_job(model, plan, _offline(16))
    sim = simulate_job(model, plan, _offline(16), JobConfig(max_num_seqs=1024, max_num_batched_tokens=1 << 16,
                                                            routing=Routing("zipf", 1.2), seed=1)).summary()
    assert sim["tpot_s_p50"] > 1.05 * cf["tpot_s_p50"] and sim["ttft_s_p50"] > cf["ttft_s_p50"]
    assert sim["throughput_tok_s"] < cf["throughput_tok_s"] / 1.05


def test_arrivals_below_capacity_vs_closed_form():
    """Requests trickling in never form the closed form's full batch: each prefill is small (TTFT
    below the batch prefill), decode batches are small (TPOT below), and the arrival rate, not
    the hardware, bounds the throughput."""
    model, plan = _model(), Plan(1, 1, 1, 2, 1, 32)
    lone = simulate_job(model, plan, _offline(1), BIG).latency_s[0]
    req = poisson_requests(32, 2.0 / lone, LengthDist("fixed", P), LengthDist("fixed", O), seed=3)
    cf, sim = closed_form_job(model, plan, req), simulate_job(model, plan, req, BIG).summary()
    assert sim["ttft_s_p50"] < cf["ttft_s_p50"] and sim["tpot_s_p50"] < cf["tpot_s_p50"]
    assert sim["throughput_tok_s"] < 0.5 * cf["throughput_tok_s"]


def test_arrivals_above_capacity_queue_beyond_closed_form():
    """Far more requests than seats arriving at once: the closed form's TTFT is one prefill; in
    the job later requests wait for seats, so the median TTFT is several prefills."""
    model, plan = _model(), Plan(1, 1, 1, 2, 1, 8)
    req = _offline(64)
    cfg = JobConfig(max_num_seqs=8, max_num_batched_tokens=1 << 16)
    cf, sim = closed_form_job(model, plan, req), simulate_job(model, plan, req, cfg).summary()
    assert sim["ttft_s_p50"] > 3 * cf["ttft_s_p50"]
    assert sim["tpot_s_p50"] == pytest.approx(cf["tpot_s_p50"], rel=0.2)


@pytest.mark.parametrize("group,m", [(1, 1), (2, 1), (4, 2), (8, 2)])
def test_colocated_fixed_batch_reproduces_closed_form(group, m):
    hw = synthetic_hw(link_bw=1e8)
    cm = ColocatedModel(TINY, RooflineTimes(hw, TINY), Workload(P, O))
    plan = ColocatedPlan(group, m, 32)
    tok = np.full((1, m), 32 / m)
    counts = draw_counts(None, tok.sum(axis=0), TINY.top_k, TINY.num_experts, TINY.num_layers, None)
    got = ColocatedPipeline(cm, plan).iteration(0.0, tok, np.full_like(tok, cm.wl.ctx_mean), tok, counts)
    assert got == pytest.approx(cm.predict(plan).t_iter, rel=1e-9)
    # a whole offline job: decode iterations at the closed form's mean context -> TPOT = t_iter
    r = simulate_colocated_job(cm, plan, _offline(32), BIG)
    assert np.nanmedian(r.tpot_s) == pytest.approx(cm.predict(plan).t_iter, rel=1e-9)
    # skew, compute-bound experts: the busiest device sets the expert stage
    if group > 1:
        hw = synthetic_hw(flops=1e9, link_bw=1e18)
        cm = ColocatedModel(TINY, RooflineTimes(hw, TINY), Workload(P, O))
        bal = simulate_colocated_job(cm, plan, _offline(32), BIG)
        z = simulate_colocated_job(cm, plan, _offline(32), JobConfig(
            max_num_seqs=1024, max_num_batched_tokens=1 << 16, routing=Routing("zipf", 1.5), seed=2))
        assert np.nanmedian(z.tpot_s) > 1.05 * np.nanmedian(bal.tpot_s)


def test_workload_job_releases_arrivals(tmp_path):
    """perf/jobs/workload_job.py under mpiexec -n 3 (2 replicas + 1 expert rank), tiny model: requests
    start only after their arrival time, all finish with their output length, and the routers'
    recorded (token, expert) pairs per layer equal the tokens the job fed through the model."""
    reqs = [{"arrival_s": a, "prompt_len": p, "output_len": o}
            for a, p, o in ((0.0, 6, 3), (0.0, 9, 2), (0.0, 4, 4), (0.8, 5, 3), (0.8, 7, 2), (1.0, 3, 3))]
    trace = tmp_path / "w.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    out = tmp_path / "o.json"
    script = perf_script("jobs/workload_job.py")
    run_mpi(3, script, [out, trace, "--replicas", 2, "--m", 2, "--hidden", 64, "--inter", 64, "--layers", 2,
                        "--heads", 4, "--kv-heads", 2, "--experts", 4, "--top-k", 2, "--vocab", 128], timeout=120)
    d = json.loads(out.read_text())
    got = {r["id"]: r for r in d["requests"]}
    assert sorted(got) == [f"r{i}" for i in range(len(reqs))]
    for i, q in enumerate(reqs):
        r = got[f"r{i}"]
        assert r["output_len"] == q["output_len"]
        assert q["arrival_s"] < r["first_token_s"] <= r["finish_s"]
    fed = sum(q["prompt_len"] + q["output_len"] - 1 for q in reqs)  # the last token is not fed back
    assert np.asarray(d["route_counts"]).sum(axis=1).tolist() == [fed * 2] * 2
    s = measured_summary(d)
    assert s["ttft_s_p50"] > 0 and s["throughput_tok_s"] > 0


def test_bad_iteration_overhead_named():
    from megainfer.config import ConfigError
    with pytest.raises(ConfigError, match="job.iteration_overhead_s"):
        JobConfig(iteration_overhead_s=-1.0)
