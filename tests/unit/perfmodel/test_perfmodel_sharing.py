"""Ranks time-sharing a CPU node's cores: PD's prefill ranks beside its decode ranks
(perfmodel/sim/pd.py ``_Node``) and other tenants' threads (``node.background_load``),
each checked on a case with a closed-form answer."""
import dataclasses

import numpy as np
import pytest

from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.hardware import NodeProfile, with_background_load
from megainfer.perfmodel.model.layer_times import layer_times_for
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model
from megainfer.perfmodel.sim.events import Requests
from megainfer.perfmodel.sim.job import JobConfig
from megainfer.perfmodel.sim.pd import simulate_pd_job
from perfmodel_helpers import TINY, synthetic_hw

WL = Workload(64, 16)


def _hw(cores: int):
    hw = synthetic_hw(mem=4e7)
    return dataclasses.replace(hw, node=NodeProfile(cores=cores)) if cores else hw


def _one_token_job(hw, n_p: int):
    """n_p prompts of 64 tokens at t = 0, one per prefill replica, one output token (no decode)."""
    pool = PrefillPool(TINY, hw, n_p, 1)
    model = decode_model(TINY, hw, hw, WL, "bfloat16", True)
    reqs = Requests(np.zeros(n_p), np.full(n_p, 64), np.ones(n_p, np.int64))
    r = simulate_pd_job(pool, model, Plan(1, 1, 1, 2, 1, n_p, hw.name, hw.name), reqs, JobConfig())
    t, L = pool.t, TINY.num_layers
    alone = L * t.t_attn(64, 32.5) + L * t.t_expert([64 * TINY.top_k / TINY.num_experts] * 8) + t.t_head(1)
    return r, alone


@pytest.mark.parametrize("cores,n_p,stretch", [(0, 2, 1.0), (1, 1, 1.0), (1, 2, 2.0), (2, 2, 1.0),
                                               (1, 3, 3.0)])
def test_prefill_replicas_time_share_the_cores(cores, n_p, stretch):
    """k prefill replicas computing at once on c cores each take max(1, k / c) x the step alone;
    one alone on a shared node, or any number on GPUs (cores 0), takes exactly the step."""
    r, alone = _one_token_job(_hw(cores), n_p)
    assert np.allclose(r.ttft_s, stretch * alone, rtol=1e-9)


def test_a_prefill_step_beside_decoding_is_stretched_only_while_decode_runs():
    """One core: a long prompt arriving while a short request decodes progresses at the decode
    ranks' shared rate while decode runs and at full speed after, so its TTFT lies strictly
    between the step alone and the step fully dilated; decode iterations during the step are
    slower than those after it (the prefill rank takes its share)."""
    hw = _hw(1)
    pool = PrefillPool(TINY, hw, 1, 1)
    model = decode_model(TINY, hw, hw, WL, "bfloat16", True)
    plan = Plan(1, 1, 1, 2, 1, 2, hw.name, hw.name)
    reqs = Requests(np.array([0.0, 1e-9]), np.array([8, 256]), np.array([40, 1]))
    r = simulate_pd_job(pool, model, plan, reqs, JobConfig(max_num_batched_tokens=512))
    t, L = pool.t, TINY.num_layers
    alone = L * t.t_attn(256, 128.5) + L * t.t_expert([256 * TINY.top_k / TINY.num_experts] * 8) + t.t_head(1)
    first_end = r.first_token_s[0]
    ttft = r.ttft_s[1] + 1e-9  # its step starts when the first one's ends
    step = ttft - first_end
    assert alone * 1.05 < step < alone * 3.0
    gpu = simulate_pd_job(PrefillPool(TINY, _hw(0), 1, 1), decode_model(TINY, _hw(0), _hw(0), WL, "bfloat16", True),
                          plan, reqs, JobConfig(max_num_batched_tokens=512))
    assert gpu.ttft_s[1] + 1e-9 - gpu.first_token_s[0] == pytest.approx(alone, rel=1e-9)
    its = np.array([(s, d) for s, d, _ in r.iteration_s])
    during = its[its[:, 0] < r.first_token_s[1], 1]
    after = its[its[:, 0] > r.first_token_s[1], 1]
    assert len(during) and len(after) and during.mean() > 1.2 * after.mean()


def test_background_load_time_shares_the_cores():
    """b other threads on c cores: k busy ranks run at max(1, (k + b) / c) x alone."""
    n = NodeProfile(cores=2, background_load=2.0)
    assert n.dilation("attention", 1) == pytest.approx(1.5)
    assert n.dilation("attention", 2) == pytest.approx(2.0)
    assert n.dilation("expert", 4) == pytest.approx(3.0)
    assert NodeProfile(cores=2, background_load=0.5).dilation("expert", 1) == 1.0
    assert NodeProfile(cores=0, background_load=8.0).dilation("expert", 4) == 1.0  # GPUs: own device


def test_background_load_narrows_the_micro_batch_penalty_on_a_full_node():
    """2 attention + 2 expert ranks on 2 cores, T_e = T_a: with m = 1 the sides alternate (2
    ranks busy), with m = 2 they overlap (4 busy). Alone on the node m = 2 doubles every stage
    (4 ranks, 2 cores); with b other threads the stretch is (4 + b) / (2 + b) instead, so the
    m = 2 / m = 1 iteration ratio falls as the node gets busier (the runtime measured m = 2
    no slower than m = 1 at load average 4-16, docs/perfmodel.md "The planner at launch")."""
    hw = _hw(2)

    def terms(b, m):
        h = with_background_load(hw, b)
        model = DisaggModel(TINY, layer_times_for(h, TINY, "bfloat16"), layer_times_for(h, TINY, "bfloat16"), WL)
        return model.plan_node_terms(Plan(1, 2, 1, 2, m, 32, h.name, h.name))

    for b in (0.0, 2.0, 6.0):
        _, _, d_a1, d_e1 = terms(b, 1)
        assert d_a1 == pytest.approx(max(1.0, (2 + b) / 2)) and d_e1 == pytest.approx(d_a1)
        _, _, d_a2, d_e2 = terms(b, 2)
        assert max(d_a2, d_e2) == pytest.approx(max(1.0, (4 + b) / 2))
    ratio = [max(terms(b, 2)[2:]) / max(terms(b, 1)[2:]) for b in (0.0, 2.0, 6.0)]
    assert ratio == pytest.approx([2.0, 1.5, 1.25])
    assert with_background_load(_hw(0), 5.0).node.background_load == 0.0  # GPU profile unchanged
