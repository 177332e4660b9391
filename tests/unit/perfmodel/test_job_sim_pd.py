"""The PD job simulator (perfmodel/sim/pd.py): prefill replicas, KV transfers and the decode
pool in one event loop, checked against closed forms and against the composed PD model.

A PD prefill step beside a decode pool that has nothing to decode but whose ranks still take
a share of a core each (``simulate_pd_job(idle_decode_busy=)``, pd_parts.Node): the CPU runtime
steps its lock-step decode pipeline with empty batches and its ranks poll while it waits.

A PD prefill step's per-prompt host work: ``PrefillPool(prompt_host_s=)`` seconds per prompt
in the step and per layer (the CPU runtime gathers, copies and posts each prompt's layer KV and
keeps its books), beyond the layer times."""
import dataclasses

import numpy as np
import pytest

from megainfer.config import ConfigError
from megainfer.perfmodel.sim.events import LengthDist, Requests, poisson_requests
from megainfer.perfmodel.plan.goodput import (PrefillPool, decode_model, kv_transfer_s,
                                         simulate_pd_composed)
from megainfer.perfmodel.model.hardware import NodeProfile
from megainfer.perfmodel.sim.job import JobConfig
from megainfer.perfmodel.model.disagg import Plan, Workload
from megainfer.perfmodel.sim.pd import simulate_pd_job
from perfmodel_helpers import TINY, synthetic_hw

HW = synthetic_hw(mem=4e7)
WL = Workload(64, 16)


def _plan(n_a=1, m=1, hw=HW):
    return Plan(1, n_a, 1, 2, m, n_a, hw.name, hw.name)


def test_one_request_is_a_prefill_step_a_transfer_and_decode_steps():
    pool = PrefillPool(TINY, HW, 1, 1)
    model = decode_model(TINY, HW, HW, WL, "bfloat16", True)
    reqs = Requests(np.array([0.5]), np.array([64]), np.array([9]))
    r = simulate_pd_job(pool, model, _plan(), reqs, JobConfig())
    t, L = pool.t, TINY.num_layers
    prefill = (L * t.t_attn(64, 32.5) + t.t_expert([64 * TINY.top_k / TINY.num_experts] * 8)
               * L + t.t_head(1))
    assert r.ttft_s[0] == pytest.approx(prefill, rel=1e-9)
    assert len(r.prefill_steps) == 1 and len(r.iteration_s) == 8
    # the KV streams during the step: only the last layer's share is left after it (+ latency)
    kv = kv_transfer_s(TINY, np.array([64]), pool, HW, 1, "bfloat16")[0]
    assert r.handoff_s[0] == pytest.approx(max(kv - HW.inter_link.latency_s,
                                               (kv - HW.inter_link.latency_s) / L)
                                           - prefill + HW.inter_link.latency_s, rel=1e-6) \
        if kv > prefill else r.handoff_s[0] == pytest.approx(
            (kv - HW.inter_link.latency_s) / L + HW.inter_link.latency_s, rel=1e-6)
    # decode: 8 steps of one sequence at contexts 65..72, each a single-sequence iteration
    dec = [s[1] for s in r.iteration_s]
    one = model.predict(_plan()).t_iter  # the closed form's iteration at the mean context
    assert np.mean(dec) == pytest.approx(one, rel=0.05)
    assert r.finish_s[0] == pytest.approx(r.iteration_s[-1][0] + r.iteration_s[-1][1])


@pytest.mark.parametrize("n_a,m,n_p", [(1, 1, 1), (2, 2, 2)])
def test_light_load_agrees_with_the_composed_model(n_a, m, n_p):
    """Below capacity nothing queues or contends, so one loop and the composition agree."""
    reqs = poisson_requests(60, 3000.0, LengthDist("fixed", 64), LengthDist("fixed", 16), seed=1)
    pool = PrefillPool(TINY, HW, n_p, 1)
    cfg = JobConfig(max_num_seqs=32)
    one = simulate_pd_job(pool, decode_model(TINY, HW, HW, WL, "bfloat16", True), _plan(n_a, m),
                          reqs, cfg)
    comp = simulate_pd_composed(pool, decode_model(TINY, HW, HW, WL, "bfloat16", True, 64.0),
                                _plan(n_a, m), reqs, cfg, "bfloat16")
    assert np.median(one.ttft_s) == pytest.approx(np.median(comp.ttft_s), rel=0.01)
    assert np.median(one.tpot_s) == pytest.approx(np.median(comp.tpot_s), rel=0.05)
    assert np.all(~np.isnan(one.finish_s))


def test_kv_transfers_into_one_replica_share_its_link():
    """Two prompts prefilled in one step, their KV to the same decode replica over a slow
    link: the second transfer waits for the first (the composition gives every transfer the
    whole link)."""
    slow = synthetic_hw(name="slow", mem=4e7, link_bw=1e6)
    pool = PrefillPool(TINY, slow, 1, 1)
    reqs = Requests(np.zeros(2), np.array([64, 64]), np.array([4, 4]))
    r = simulate_pd_job(pool, decode_model(TINY, slow, slow, WL, "bfloat16", True),
                        _plan(hw=slow), reqs, JobConfig())
    assert len(r.prefill_steps) == 1 and r.first_token_s[0] == r.first_token_s[1]
    per = 64 * TINY.kv_bytes_per_token("bfloat16") / 1e6
    assert sorted(r.kv_ready_s)[1] - sorted(r.kv_ready_s)[0] == pytest.approx(per, rel=1e-9)
    assert r.handoff_s.max() - r.handoff_s.min() == pytest.approx(per, rel=1e-9)
    # the first decodes while the second's KV is on the link: each of those iterations waits
    # for one layer's message of it; the iterations after it do not
    during = [d for t0, d, _ in r.iteration_s if t0 < r.kv_ready_s.max()]
    after = [d for t0, d, _ in r.iteration_s if t0 >= r.kv_ready_s.max()]
    assert during and after and min(during) >= per / TINY.num_layers > max(after)


def test_prefill_replicas_batch_prompts_under_overload():
    """Past one-prompt-at-a-time capacity the prefill scheduler batches prompts into its token
    budget, so TTFT queues less than the composition's one-prompt queue; with a budget of one
    prompt the two agree."""
    reqs = poisson_requests(200, 30000.0, LengthDist("fixed", 64), LengthDist("fixed", 4), seed=0)
    pool = PrefillPool(TINY, HW, 1, 1)
    model = decode_model(TINY, HW, HW, WL, "bfloat16", True)
    batched = simulate_pd_job(pool, model, _plan(), reqs, JobConfig(max_num_seqs=64))
    single = simulate_pd_job(pool, model, _plan(), reqs, JobConfig(max_num_seqs=64), prefill_tokens=64)
    comp = simulate_pd_composed(pool, decode_model(TINY, HW, HW, WL, "bfloat16", True, 64.0),
                                _plan(), reqs, JobConfig(max_num_seqs=64), "bfloat16")
    assert np.median(batched.ttft_s) < 0.6 * np.median(comp.ttft_s)
    assert np.median(single.ttft_s) == pytest.approx(np.median(comp.ttft_s), rel=0.02)


def test_one_token_outputs_finish_at_prefill_and_admission_respects_max_num_seqs():
    pool = PrefillPool(TINY, HW, 2, 1)
    reqs = Requests(np.zeros(6), np.full(6, 32), np.array([1, 1, 8, 8, 8, 8]))
    r = simulate_pd_job(pool, decode_model(TINY, HW, HW, WL, "bfloat16", True), _plan(),
                        reqs, JobConfig(max_num_seqs=2))
    assert np.array_equal(r.finish_s[:2], r.first_token_s[:2])
    assert np.all(~np.isnan(r.finish_s))
    # at most 2 requests handed to the one decode replica at once: decode batches of <= 2
    assert max(it[2] for it in r.iteration_s) <= 2


def _ttft(cores: int, idle: float, n_a: int = 1) -> tuple[float, float]:
    """One 64-token prompt with a one-token output (no decode ever runs): (TTFT, step alone)."""
    hw = synthetic_hw(mem=4e7)
    hw = dataclasses.replace(hw, node=NodeProfile(cores=cores)) if cores else hw
    pool = PrefillPool(TINY, hw, 1, 1)
    reqs = Requests(np.zeros(1), np.array([64]), np.ones(1, np.int64))
    r = simulate_pd_job(pool, decode_model(TINY, hw, hw, WL, "bfloat16", True),
                        Plan(1, n_a, 1, 2, 1, 1, hw.name, hw.name), reqs, JobConfig(), idle_decode_busy=idle)
    t, L = pool.t, TINY.num_layers
    alone = L * t.t_attn(64, 32.5) + L * t.t_expert([64 * TINY.top_k / TINY.num_experts] * 8) + t.t_head(1)
    return float(r.ttft_s[0]), alone


@pytest.mark.parametrize("cores,idle,n_a,stretch", [
    (1, 0.0, 1, 1.0),    # the decode pool waits without computing: the step alone
    (1, 0.5, 1, 2.5),    # one core, 3 decode ranks (1 attention + 2 expert) at half a core each
    (1, 1.0, 2, 5.0),    # one core, 4 decode ranks always computing: 5 ranks on 1 core
    (2, 0.25, 1, 1.0),   # two cores, 1 + 0.75 ranks' demand: no sharing
    (2, 1.0, 1, 2.0),    # two cores, 1 + 3 ranks
    (0, 1.0, 1, 1.0),    # GPUs share nothing
])
def test_idle_decode_ranks_share_the_prefill_cores(cores, idle, n_a, stretch):
    ttft, alone = _ttft(cores, idle, n_a)
    assert ttft == pytest.approx(stretch * alone, rel=1e-9)


def test_idle_decode_busy_must_be_a_fraction():
    with pytest.raises(ConfigError, match="idle_decode_busy"):
        _ttft(1, 1.5)


def _step(n_prompts: int, send: float) -> float:
    """n 32-token prompts at t = 0, one output token each: they share one prefill step."""
    pool = PrefillPool(TINY, HW, 1, 1, prompt_host_s=send)
    reqs = Requests(np.zeros(n_prompts), np.full(n_prompts, 32), np.ones(n_prompts, np.int64))
    r = simulate_pd_job(pool, decode_model(TINY, HW, HW, WL, "bfloat16", True),
                        Plan(1, 1, 1, 2, 1, n_prompts, HW.name, HW.name), reqs, JobConfig())
    assert len(r.prefill_steps) == 1
    return float(r.ttft_s.max())


@pytest.mark.parametrize("n", [1, 4])
def test_each_prompt_of_a_step_pays_its_host_work_per_layer(n):
    c = 1e-3
    assert _step(n, c) - _step(n, 0.0) == pytest.approx(n * TINY.num_layers * c, rel=1e-9)


def test_the_one_prompt_queue_pays_them_too():
    a, b = PrefillPool(TINY, HW, 1, 1), PrefillPool(TINY, HW, 1, 1, prompt_host_s=2e-3)
    assert b.t_prefill(64) - a.t_prefill(64) == pytest.approx(TINY.num_layers * 2e-3, rel=1e-9)
    with pytest.raises(ConfigError, match="prompt_host_s"):
        PrefillPool(TINY, HW, 1, 1, prompt_host_s=-1.0)
