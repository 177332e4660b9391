"""A PD prefill step's per-prompt host work: ``PrefillPool(prompt_host_s=)`` seconds per prompt
in the step and per layer (the CPU runtime gathers, copies and posts each prompt's layer KV and
keeps its books), beyond the layer times."""
import numpy as np
import pytest

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import Plan, Workload
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model
from megainfer.perfmodel.sim.events import Requests
from megainfer.perfmodel.sim.job import JobConfig
from megainfer.perfmodel.sim.pd import simulate_pd_job
from perfmodel_helpers import TINY, synthetic_hw

HW = synthetic_hw(mem=4e7)
WL = Workload(64, 16)


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
