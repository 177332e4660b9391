"""deploy=auto's serving plan considering the decode-attention offload
(world_serving.plan_world_serving(offload_ratios=), serving_plan): the best PD split is also
simulated at offload ratios 1 and 0.5, ranked by the same rule; where the decode replicas' KV
memory bounds their batch, offload wins. With pd.offload unset the planner chooses it (the
resolved config runs it, the log says why) or says why not; an explicit pd.offload pins it: the
plan chosen is one the config runs and the log says which keys would run a better one."""
import logging
import re

import yaml

from megainfer.engine.job_doors import resolve_llm_job
from megainfer.perfmodel.plan.auto_plan import model_shape
from megainfer.perfmodel.plan.goodput import Slo
from megainfer.perfmodel.plan.world_serving import ServingPins, ServingTarget, plan_world_serving
from megainfer.perfmodel.sim.events import LengthDist, poisson_requests
from perfmodel_helpers import synthetic_hw, synthetic_profile
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


def test_the_offloaded_batch_limit_counts_the_round_trips():
    """The offloaded variant's seats meet the TPOT SLO with its rows' round trip at every layer
    (RemoteAttention.rows_s): on the kv_bound profile (1 ms TPOT) 44 per replica where the
    all-local prediction allowed 59; a link 100x slower leaves fewer still, the simulation
    judging the rest."""
    from dataclasses import replace
    from megainfer.perfmodel.plan.world_serving import offloaded_variant
    from megainfer.perfmodel.plan.goodput_search import mean_workload
    from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model
    t, ranked = _kv_bound((1.0,))
    base = next(c for c in ranked if c.pool is not None and c.offload == 0)
    off = next(c for c in ranked if c.offload == 1.0)
    assert off.batch_limit == 44 and base.batch_limit == 20
    hw = synthetic_hw(mem=2.2e6, flops=1e11, bw=1e10)
    slow = replace(hw, inter_link=replace(hw.inter_link, bandwidth_Bps=hw.inter_link.bandwidth_Bps / 100))
    pool = PrefillPool(base.pool.shape, slow, 1, 1, "float32", use_fit=False)
    model = decode_model(base.pool.shape, slow, slow, mean_workload(t.requests), "float32", False)
    v = offloaded_variant(replace(base, pool=pool), 1.0, model, t, slow, mean_workload(t.requests))
    assert v is not None and v.batch_limit < off.batch_limit


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
    assert "offload" not in chosen


KV_BOUND = dict(mem=2.2e6, flops=1e11, bw=1e10)  # _kv_bound's profile


def _resolve_kv_bound(tmp_path, *overrides):
    """deploy=auto for 2000 requests/s of 64 / 128 tokens (10 ms / 1 ms SLOs) on _kv_bound's
    profile, pinned to P1 -> A2 + E1 as there."""
    hw = tmp_path / "kv_bound.yaml"
    hw.write_text(yaml.safe_dump(synthetic_profile("kv_bound", **KV_BOUND)))
    ov = ["slo.arrival_rate=2000", "slo.input_len=64", "slo.output_len=128", "slo.ttft_ms=10",
          "slo.tpot_ms=1", "slo.num_requests=64", f"deploy.hardware={hw}",
          "deploy.prefill_replicas=1", "deploy.prefill_tp=1", "deploy.expert_ranks=1",
          "deploy.attention_tp=1", "deploy.micro_batches=1", "scheduler.max_num_seqs=64",
          "scheduler.max_num_batched_tokens=512", *overrides]
    return resolve_llm_job({}, TINY, "auto", None, 4, ov).job


def _lines(caplog, part):
    return [line for line in caplog.text.splitlines() if part in line]


def test_pd_offload_unset_the_planner_chooses_it_and_says_why(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="megainfer.perfmodel"):
        job = _resolve_kv_bound(tmp_path)
    assert job.pd.offload is True and job.pd.offload_ratio == 1.0
    assert job.pd.offload_policy == "ratio" and job.pd.offload_blocks is None  # defaults kept
    assert (job.deploy.prefill_replicas, job.deploy.attention_replicas,
            job.deploy.expert_ranks) == (1, 2, 1)
    chosen, = _lines(caplog, "[plan] chosen:")
    assert "batch<=44/replica offload=1: " in chosen
    assert "100% of requests meet both, goodput 1960 req/s" in chosen
    assert ("(decode attention offloaded: goodput 1960 req/s, 100% meet both, against goodput "
            "1531 req/s, 78% meet both for the best plan without it, ") in chosen
    assert chosen.endswith("; pd.offload=true pd.offload_ratio=1 set by the planner)")
    assert not _lines(caplog, "not chosen") and not _lines(caplog, "would rank above")


def test_pd_offload_pinned_false_stays_off_and_names_the_keys(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="megainfer.perfmodel"):
        job = _resolve_kv_bound(tmp_path, "pd.offload=false")
    assert job.pd.offload is False and job.deploy.prefill_replicas == 1
    closest, = _lines(caplog, "meets the SLOs for 90% of the requests; running the closest: ")
    assert "offload" not in closest and "78% of requests meet both" in closest
    assert not _lines(caplog, "[plan] chosen:")
    above, = _lines(caplog, "would rank above the chosen plan")
    assert "offload=1" in above and above.endswith(": pd.offload=true pd.offload_ratio=1 runs it")
    assert "the config runs ratio 0 (pd.offload=false)" in caplog.text


def test_pd_offload_unset_and_ranked_below_stays_off_and_says_why(caplog):
    """The cpu_node TTFT example: the ratios tie on goodput, ratio 0 ranks first by headroom."""
    with caplog.at_level(logging.INFO, logger="megainfer.perfmodel"):
        job = _resolve(4).job
    assert job.pd.offload is False and job.deploy.prefill_replicas == 2
    chosen, = _lines(caplog, "[plan] chosen:")
    assert "offload" not in chosen
    why, = _lines(caplog, "decode-attention offload not chosen: its best plan, ")
    assert re.search(r" offload=(1|0\.5) \(goodput 3\.92 req/s, 100% meet both\), ranks below "
                     r"the chosen P2x tp1\S* -> A1x", why)
    assert why.endswith("meet both) on the same goodput, less SLO headroom; pd.offload stays false")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megainfer.perfmodel"):
        assert _resolve(4, "replan.enabled=true").job.pd.offload is False
    assert _lines(caplog, "decode-attention offload not considered: it needs prefill ranks and "
                          "replan.enabled plans AE only")


def test_pd_offload_unset_is_not_chosen_where_the_runtime_refuses_it(tmp_path, caplog):
    """A prefill replica of 2 TP ranks feeding attention TP 1: the offload ranks first but the
    runtime does not run it yet (config.pd.offload_needs): the plan runs without it."""
    with caplog.at_level(logging.INFO, logger="megainfer.perfmodel"):
        job = _resolve_kv_bound(tmp_path, "deploy.prefill_tp=2", "deploy.attention_tp=null")
    assert job.pd.offload is False and (job.deploy.prefill_tp, job.deploy.attention_tp) == (2, 1)
    why, = _lines(caplog, "[plan] decode-attention offload not chosen: ")
    assert " offload=" in why and "would rank first, but pd.offload needs deploy.prefill_tp=1 " \
        "or deploy.attention_tp=1 for now (got 2); pd.offload stays false" in why
