"""Prefill chunks and decode batches priced by their own attention fits (perfmodel/model/chunk_times.py),
in the AE job simulator (a replica that prefills and decodes) and on PD's prefill replicas."""
import numpy as np
import pytest

from megainfer.config import ConfigError
from megainfer.perfmodel.model.chunk_times import ChunkTimes
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.hardware import LayerFit
from megainfer.perfmodel.model.layer_times import FittedTimes
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model
from megainfer.perfmodel.sim.events import Requests
from megainfer.perfmodel.sim.job import JobConfig, simulate_job
from megainfer.perfmodel.sim.pd import simulate_pd_job
from perfmodel_helpers import TINY, synthetic_hw

HW = synthetic_hw(mem=4e7)
WL = Workload(64, 4)
# decode tokens cost 4x a chunk's per token, as the CPU runtime's attention does
DEC = FittedTimes(HW, TINY, LayerFit(k1=4e-4, k2=1e-3, k3=1e-5, k4=2e-4, k1_ctx=1e-6))
PRE = FittedTimes(HW, TINY, LayerFit(k1=1e-4, k2=3e-3, k3=1e-5, k4=2e-4, k1_ctx=1e-6))


def test_chunk_times_picks_the_fit_by_micro_batch_size():
    ct = ChunkTimes(DEC, PRE, 16)
    assert ct.t_attn(16, 100.0) == DEC.t_attn(16, 100.0)
    assert ct.t_attn(17, 100.0) == PRE.t_attn(17, 100.0) != DEC.t_attn(17, 100.0)
    assert ct.t_head(8) == DEC.t_head(8) and ct.wb == DEC.wb
    with pytest.raises(ConfigError, match="max_decode_tokens"):
        ChunkTimes(DEC, PRE, 0)


def _ae_job(ta):
    """One 64-token prompt, 4 new tokens, on 1 replica + 2 expert ranks, m = 1."""
    model = DisaggModel(TINY, ta, DEC, WL, "float32")
    reqs = Requests(np.zeros(1), np.array([64]), np.array([4]))
    return simulate_job(model, Plan(1, 1, 1, 2, 1, 1, HW.name, HW.name), reqs, JobConfig())


def test_ae_job_prefills_at_the_chunk_fit_and_decodes_at_the_decode_fit():
    mixed, pre, dec = _ae_job(ChunkTimes(DEC, PRE, 16)), _ae_job(PRE), _ae_job(DEC)
    # iteration 0 is the 64-token chunk: priced as with the prefill fit alone
    assert mixed.iteration_s[0][1] == pytest.approx(pre.iteration_s[0][1], rel=1e-12)
    assert mixed.iteration_s[0][1] < dec.iteration_s[0][1]
    # the decode iterations (one token) as with the decode fit alone
    for a, b in zip(mixed.iteration_s[1:], dec.iteration_s[1:]):
        assert a[1] == pytest.approx(b[1], rel=1e-12)


def test_prefill_pool_steps_at_its_own_times():
    pool = PrefillPool(TINY, HW, 1, 1, "float32", times=PRE)
    model = decode_model(TINY, HW, HW, WL, "float32", True, times=(DEC, DEC))
    reqs = Requests(np.zeros(1), np.array([64]), np.array([4]))
    r = simulate_pd_job(pool, model, Plan(1, 1, 1, 2, 1, 1, HW.name, HW.name), reqs, JobConfig())
    L = TINY.num_layers
    counts = r.prefill_steps  # one step of 64 tokens; its experts: 64 * top_k slots over 8
    assert len(counts) == 1
    attn = L * PRE.t_attn(64, 32.5) + PRE.t_head(1)
    # experts: k4 per active expert + k3 per slot, all 8 active at 128 slots (balanced routing)
    experts = L * (8 * PRE.fit.k4 + PRE.fit.k3 * 64 * TINY.top_k)
    assert r.ttft_s[0] == pytest.approx(attn + experts, rel=1e-9)
    assert pool.t is PRE
