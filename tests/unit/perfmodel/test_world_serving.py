"""deploy=auto planning a server (slo.arrival_rate set): AE and PD splits of exactly N ranks
simulated against the SLOs. A tight TTFT picks PD (decode keeps its iterations free of
prompts), a tight TPOT under heavy decode load picks AE (every rank decodes); pins hold; every
rank resolving the same config picks the same plan; bad slo.* values are named."""
import pytest

from megainfer.config import ConfigError, ModelConfig, SloConfig
from megainfer.engine.resolve import JobTree
from megainfer.engine.job_doors import resolve_llm_job
from megainfer.perfmodel.model.hardware import load_hardware
from megainfer.perfmodel.plan.auto_plan import model_shape
from megainfer.perfmodel.plan.goodput import Slo
from megainfer.perfmodel.plan.world_serving import (NoWorldPlanError, ServingPins, ServingTarget,
                                                    candidates, plan_world_serving)
from megainfer.perfmodel.sim.events import LengthDist, poisson_requests

# make_tiny's Mixtral defaults (tests' tiny checkpoints have this shape)
TINY = ModelConfig(family="mixtral", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=64,
                   max_position_embeddings=512)
TIGHT_TTFT = dict(rate=4, input_len=64, output_len=64, ttft_ms=12, tpot_ms=50)
TIGHT_TPOT = dict(rate=200, input_len=16, output_len=128, ttft_ms=2000, tpot_ms=12)


def _target(rate, input_len, output_len, ttft_ms, tpot_ms):
    reqs = poisson_requests(64, rate, LengthDist("fixed", input_len),
                            LengthDist("fixed", output_len), seed=0)
    return ServingTarget(reqs, Slo(ttft_ms / 1e3, tpot_ms / 1e3), 64, 512)


def _ranks(c) -> int:
    n_p, tp_p = c.prefill
    return c.plan.n_a * c.plan.tp_a + c.plan.n_e * c.plan.tp_e + n_p * tp_p


@pytest.mark.parametrize("slo,family", [(TIGHT_TTFT, "PD"), (TIGHT_TPOT, "AE")])
def test_the_slo_decides_between_ae_and_pd(slo, family):
    hw, t = load_hardware("cpu_node"), _target(**slo)
    ranked = plan_world_serving(model_shape(TINY), hw, t, 4)
    best = ranked[0]
    assert best.family == family and best.result.ok, [c.describe(t.slo) for c in ranked]
    assert {c.family for c in ranked} == {"AE", "PD"}  # both were simulated
    assert all(_ranks(c) == 4 and c.plan.tp_e == 1 for c in ranked)
    oks = [c.result.ok for c in ranked]
    assert oks == sorted(oks, reverse=True)  # attaining plans first
    if family == "PD":  # what PD buys: the AE plans' prompts sit in the decode iterations
        ae = next(c for c in ranked if c.family == "AE")
        assert best.result.ttft_p < ae.result.ttft_p


def test_pins_hold_and_every_candidate_spans_the_world():
    shape, hw, t = model_shape(TINY), load_hardware("cpu_node"), _target(**TIGHT_TTFT)
    every = candidates(shape, hw, t, 5)
    assert {c.family for c in every} == {"AE", "PD"} and all(_ranks(c) == 5 for c in every)
    ae = plan_world_serving(shape, hw, t, 4, ServingPins(prefill_replicas=0))
    assert {c.family for c in ae} == {"AE"}
    pd = plan_world_serving(shape, hw, t, 4, ServingPins(prefill_replicas=1, prefill_tp=1,
                                                         expert_ranks=1))
    assert {(c.prefill, c.plan.n_e) for c in pd} == {((1, 1), 1)}
    with pytest.raises(NoWorldPlanError, match="pins"):
        plan_world_serving(shape, hw, t, 4, ServingPins(prefill_replicas=3))


def _resolve(world, *overrides, rank=None):
    slo = TIGHT_TTFT
    ov = [f"slo.arrival_rate={slo['rate']}", f"slo.ttft_ms={slo['ttft_ms']}",
          f"slo.tpot_ms={slo['tpot_ms']}", f"slo.input_len={slo['input_len']}",
          f"slo.output_len={slo['output_len']}", *overrides]
    return resolve_llm_job({}, TINY, "auto", None, world, ov)


def test_deploy_auto_with_an_arrival_rate_runs_the_serving_plan_on_every_rank():
    got = _resolve(4)
    plan = got.job.deploy
    assert plan.mode == "disaggregated" and plan.world_size == 4
    best = plan_world_serving(model_shape(TINY), load_hardware("cpu_node"),
                              _target(**TIGHT_TTFT), 4)[0]
    assert (plan.prefill_replicas, plan.prefill_tp) == best.prefill == (2, 1)
    assert (plan.attention_replicas, plan.attention_tp, plan.expert_ranks,
            plan.micro_batches) == (best.plan.n_a, best.plan.tp_a, best.plan.n_e, best.plan.m)
    assert got.job.slo.arrival_rate == 4
    spec = JobTree(got.spec.tree, 4)  # what every rank resolves for itself
    assert all(spec.resolve(r, holds_cache=False).deploy == plan for r in (0, 3))
    assert _resolve(4, "deploy.prefill_replicas=0").job.deploy.prefill_replicas == 0
    assert _resolve(4, "replan.enabled=true").job.deploy.prefill_replicas == 0
    offline = resolve_llm_job({}, TINY, "auto", None, 4, []).job.deploy  # no rate: no PD
    assert offline.prefill_replicas == 0 and offline.world_size == 4


@pytest.mark.parametrize("key,value", [("arrival_rate", -1), ("ttft_ms", 0), ("percentile", 101),
                                       ("num_requests", 0), ("input_len", 1.5)])
def test_bad_slo_values_are_named(key, value):
    with pytest.raises(ConfigError, match=rf"slo\.{key}="):
        SloConfig(**{key: value})
    with pytest.raises(ConfigError, match=rf"slo\.{key}="):
        resolve_llm_job({}, TINY, "auto", None, 4, ["slo.arrival_rate=4", f"slo.{key}={value}"])
