"""Prefill-decode disaggregation (docs/pd.md) under real mpiexec: the rank order, greedy
tokens identical to single mode with prefill ranks (layouts, MLA, quantised caches, a small
decode pool), cache-aware routing over prefill ranks, and a failed prefill rank ending the job.
The streaming itself: tests/unit/runtime/test_kv_stream.py; megainfer-launch: tests/distributed/test_pd_launch.py."""
import json
import os
import time

import pytest

from conftest import FAMILIES
from mpi_util import run_mpi

from megainfer.config import ConfigError, DeployPlan
from megainfer.runtime.roles import assign_role, prefill_rank_ids

JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "pd_job.py")


def test_rank_order_prefill_last():
    plan = DeployPlan(mode="disaggregated", attention_replicas=2, attention_tp=1, expert_ranks=2,
                      prefill_replicas=2)
    assert plan.world_size == 6
    kinds = [assign_role(plan, r, 6).kind for r in range(6)]
    assert kinds == ["attention", "attention", "expert", "expert", "prefill", "prefill"]
    assert assign_role(plan, 5, 6).label == "[prefill 1]"
    assert prefill_rank_ids(plan) == [4, 5]
    assert DeployPlan(mode="disaggregated", expert_ranks=2).world_size == 3  # unchanged
    with pytest.raises(ConfigError, match="deploy.prefill_tp"):
        DeployPlan(mode="disaggregated", expert_ranks=1, prefill_replicas=1, prefill_tp=0)
    tp = DeployPlan(mode="disaggregated", expert_ranks=1, prefill_replicas=2, prefill_tp=2)
    assert tp.world_size == 6 and prefill_rank_ids(tp) == [2, 4]
    assert [assign_role(tp, r, 6).prefill_index for r in range(2, 6)] == [0, 0, 1, 1]
    with pytest.raises(ConfigError, match="deploy.prefill_replicas"):
        DeployPlan(mode="colocated", attention_replicas=2, prefill_replicas=1)
    with pytest.raises(ConfigError, match="deploy.prefill_replicas"):
        DeployPlan(mode="disaggregated", expert_ranks=1, prefill_replicas=-1)


LAYOUTS = [  # (decode replicas, decode tp, expert ranks, prefill ranks, families)
    (1, 1, 2, 1, FAMILIES), (1, 1, 1, 2, FAMILIES), (1, 2, 1, 1, ("mixtral",)),
    (2, 1, 1, 1, ("mixtral",))]


@pytest.mark.parametrize("A,TP,E,P,fams", LAYOUTS,
                         ids=[f"{p}p_a{a}tp{t}e{e}" for a, t, e, p, _ in LAYOUTS])
def test_greedy_tokens_equal_single_mode(tiny_ckpts, single_mode_tokens, tmp_path,
                                         A, TP, E, P, fams):
    ckpts = [tiny_ckpts[(fam, "base")] for fam in fams]
    out = tmp_path / "out.json"
    run_mpi(A * TP + E + P, JOB, [out, A, TP, E, P, "2", ",".join(ckpts)], timeout=600)
    got = json.loads(out.read_text())
    for ckpt in ckpts:
        assert got[f"{ckpt}|m=2"] == single_mode_tokens[ckpt], ckpt
        stats = got[f"{ckpt}|m=2|stats"]
        assert stats["handoffs"] == 7  # every request was prefilled elsewhere and handed over
        assert sum(stats["prefilled"]) == 7 and min(stats["prefilled"]) > 0
        assert min(stats["assigned"]) > 0


def test_idle_decode_pool_sleeps_until_a_prefill_report(tiny_ckpts, single_mode_tokens,
                                                        tmp_path):
    """Prefill steps slowed to 0.2 s: while nothing can be decoded (transfers pending or not),
    rank 0 waits for a prefill report instead of stepping empty iterations flat out, so the
    decode pool's iterations with nothing to decode stay within a few per report."""
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, 1, 2, 1, "1", ckpt, "prefill_delay=0.2"], timeout=600)
    got = json.loads(out.read_text())
    assert got[f"{ckpt}|m=1"] == single_mode_tokens[ckpt]
    stats = got[f"{ckpt}|m=1|stats"]
    idle, timed_out = stats["idle"]
    assert 0 < idle <= 2 * stats["reports"] + timed_out + 4, stats


def test_hung_prefill_rank_aborts_naming_it(tiny_ckpts, tmp_path):
    ckpt = tiny_ckpts[("mixtral", "base")]
    t0 = time.process_time()
    with pytest.raises(AssertionError) as e:
        run_mpi(4, JOB, [tmp_path / "o.json", 1, 1, 2, 1, "2", ckpt, "fault=hang"], timeout=300)
    msg = str(e.value)
    assert "exited" in msg  # it ended by itself, not by the test's timeout
    assert "rank 3 did not answer within" in msg and "prefill of request 'r" in msg
    assert time.process_time() - t0 < 60


def test_killed_prefill_rank_ends_the_job(tiny_ckpts, tmp_path):
    ckpt = tiny_ckpts[("mixtral", "base")]
    with pytest.raises(AssertionError) as e:
        run_mpi(4, JOB, [tmp_path / "o.json", 1, 1, 2, 1, "2", ckpt, "fault=kill"], timeout=300)
    assert "exited" in str(e.value) and not (tmp_path / "o.json").exists()


def _single_mode(path: str, kv_cache_dtype: str, shared: bool = False,
                 gran: str = "token_head") -> dict:
    import dataclasses
    import sys
    sys.path.insert(0, os.path.dirname(JOB))
    import runtime_job
    from runtime_job import CACHE, SCHED
    make_inputs = runtime_job.shared_inputs if shared else runtime_job.inputs

    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.engine.engine import LLMEngine
    from megainfer.models import build_model
    cfg = ModelConfig.from_pretrained(path)
    engine = LLMEngine.from_model(build_model(cfg, LoadConfig(path=path)), SCHED,
                                  dataclasses.replace(CACHE, kv_cache_dtype=kv_cache_dtype,
                                                      kv_scale_granularity=gran))
    return {o.request_id: o.outputs[0].token_ids
            for o in engine.generate_stream(make_inputs(cfg.vocab_size, 12))}


CACHES = [  # (family, cache.kv_cache_dtype, decode tp, cache.kv_scale_granularity, prefill ranks)
    ("deepseek_v3", "auto", 2, "tensor", 1), ("deepseek_v3", "fp8_e4m3", 1, "token_head", 1),
    ("mixtral", "fp4_e2m1", 1, "token_head", 2), ("mixtral", "fp8_e4m3", 1, "tensor", 1)]


@pytest.mark.parametrize("fam,kv,TP,gran,P", CACHES,
                         ids=[f"{f}-{k}-tp{t}-{g}-{p}p" for f, k, t, g, p in CACHES])
def test_mla_and_quantised_caches_equal_single_mode(tiny_ckpts, tmp_path_factory, tmp_path,
                                                    fam, kv, TP, gran, P):
    """The MLA latent (every decode TP rank gets the whole latent) and quantised caches.
    token_head scales: every row carries its own, the bytes travel verbatim, so two prefill
    ranks (each computing some prompts) send single mode's bytes too. tensor scales: with one
    prefill rank its first prefill step is single mode's, so its per-layer scales are single
    mode's, and the decode replica adopts them with the first transfer. The tokens match single
    mode's either way (decode side with 2 micro-batches)."""
    if fam == "deepseek_v3":
        from megainfer.tools.make_tiny import make_tiny
        ckpt = make_tiny("deepseek_v3", str(tmp_path_factory.mktemp("dsv3") / "c"), seed=1)
    else:
        ckpt = tiny_ckpts[(fam, "base")]
    out = tmp_path / "out.json"
    run_mpi(TP + 1 + P, JOB, [out, 1, TP, 1, P, "2", ckpt, f"kv={kv}", f"gran={gran}"],
            timeout=600)
    got = json.loads(out.read_text())
    assert got[f"{ckpt}|m=2"] == _single_mode(ckpt, kv, gran=gran)
    assert min(got[f"{ckpt}|m=2|stats"]["prefilled"]) > 0  # every prefill rank computed some


def test_small_decode_pool_waits_to_reserve_and_preempts(tiny_ckpts, single_mode_tokens,
                                                         tmp_path):
    """34 blocks of 4: the decode replica cannot reserve every prompt at once (reservations
    wait their turn) and preempts; preempted handed-off requests recompute there."""
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    run_mpi(3, JOB, [out, 1, 1, 1, 1, "2", ckpt, "blocks=34"], timeout=600)
    got = json.loads(out.read_text())
    assert got[f"{ckpt}|m=2"] == single_mode_tokens[ckpt]
    assert got[f"{ckpt}|m=2|stats"]["preemptions"] > 0


def test_cache_aware_routing_over_prefill_ranks(tiny_ckpts, tmp_path):
    """Shared-prefix prompts over 2 prefill ranks: cache-aware routing (the prefill ranks report
    their cache's keys) serves at least as many prompt tokens from the prefix caches as
    round-robin, and both give single mode's tokens."""
    ckpt = tiny_ckpts[("mixtral", "base")]
    want, cached = _single_mode(ckpt, "auto", shared=True), {}
    for routing in ("round_robin", "cache_aware"):
        out = tmp_path / f"{routing}.json"
        run_mpi(4, JOB, [out, 1, 1, 1, 2, "2", ckpt, "prompts=shared", f"routing={routing}"],
                timeout=600)
        got = json.loads(out.read_text())
        assert got[f"{ckpt}|m=2"] == want, routing
        cached[routing] = got[f"{ckpt}|m=2|stats"]["cached"]
    assert cached["cache_aware"] >= cached["round_robin"] > 0, cached
