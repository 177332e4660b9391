"""A PD prefill step beside a decode pool that has nothing to decode but whose ranks still take
a share of a core each (``simulate_pd_job(idle_decode_busy=)``, pd_parts.Node): the CPU runtime
steps its lock-step decode pipeline with empty batches and its ranks poll while it waits."""
import dataclasses

import numpy as np
import pytest

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import Plan, Workload
from megainfer.perfmodel.model.hardware import NodeProfile
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model
from megainfer.perfmodel.sim.events import Requests
from megainfer.perfmodel.sim.job import JobConfig
from megainfer.perfmodel.sim.pd import simulate_pd_job
from perfmodel_helpers import TINY, synthetic_hw

WL = Workload(64, 16)


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
