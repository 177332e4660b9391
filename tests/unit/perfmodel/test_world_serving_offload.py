"""deploy=auto's serving plan considering the decode-attention offload
(world_serving.plan_world_serving(offload_ratios=), serving_plan): the best PD split is also
simulated at offload ratios 1 and 0.5, ranked by the same rule; where the decode replicas' KV
memory bounds their batch, offload wins; the plan chosen is one the config runs and the log
says how the ratios compared and which keys would run a better one."""
import logging

from megainfer.perfmodel.plan.auto_plan import model_shape
from megainfer.perfmodel.plan.goodput import Slo
from megainfer.perfmodel.plan.world_serving import ServingPins, ServingTarget, plan_world_serving
from megainfer.perfmodel.sim.events import LengthDist, poisson_requests
from perfmodel_helpers import synthetic_hw
from test_world_serving import TINY, _resolve

PINS = ServingPins(prefill_replicas=1, prefill_tp=1, expert_ranks=1, attention_tp=1,
                   micro_batches=1)  # P1 -> A2 + E1, m = 1


def _kv_bound(offload_ratios):
    """Memory for about 20 sequences of 64 + 128 tokens per decode replica at 2000 requests/s."""
    hw = synthetic_hw(mem=2.2e6, flops=1e11, bw=1e10)
    reqs = poisson_requests(64, 2000, LengthDist("fixed", 64), LengthDist("fixed", 128), seed=0)
    t = ServingTarget(reqs, Slo(0.01, 0.001), 64, 512)
    return t, plan_world_serving(model_shape(TINY), hw, t, 4, PINS, "float32", use_fit=False,
                                 offload_ratios=offload_ratios)


def _key(c):
    return (not c.result.ok, -c.result.goodput_req_s, c.headroom(SLO), c.label())


SLO = Slo(0.01, 0.001)


def test_offload_wins_where_the_decode_kv_memory_bounds_the_batch():
    t, ranked = _kv_bound((1.0, 0.5))
    assert [c.offload for c in ranked if c.pool] and {0.0, 0.5, 1.0} <= {c.offload for c in ranked}
    assert [_key(c) for c in ranked] == sorted(_key(c) for c in ranked)  # the same rule
    base = next(c for c in ranked if c.offload == 0)
    best = ranked[0]
    assert best.offload > 0 and best.result.ok and not base.result.ok
    assert best.result.goodput_req_s > 1.2 * base.result.goodput_req_s
    # offloaded requests keep their KV on the prefill rank: the seats are not KV-bound
    assert best.batch_limit > base.batch_limit
    assert best.plan.label() == base.plan.label() and best.prefill == base.prefill
    _, plain = _kv_bound(())
    assert all(c.offload == 0 for c in plain)  # no ratios: the planner as before


def test_deploy_auto_runs_what_the_config_runs_and_says_how_the_offload_compared(caplog):
    with caplog.at_level(logging.INFO, logger="megainfer.perfmodel"):
        _resolve(4, "pd.offload=true", "pd.offload_ratio=0.5")
    text = caplog.text
    chosen = next(line for line in text.splitlines() if "[plan] chosen:" in line)
    assert "offload=0.5" in chosen
    assert "decode-attention offload on" in text and "the config runs ratio 0.5" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megainfer.perfmodel"):
        _resolve(4)
    chosen = next(line for line in caplog.text.splitlines() if "[plan] chosen:" in line)
    assert "offload" not in chosen and "the config runs ratio 0 (pd.offload=false)" in caplog.text
