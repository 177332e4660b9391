"""The decode-attention offload in the PD job simulator (perfmodel/sim/pd_offload.py, pd.py's
``offload=`` and ``decode_kv_tokens=``): ratio 0 is today's simulator bit for bit, the
runtime ledger's choice of requests, the KV that stays (ready one latency after the first
token), a KV-limited decode pool that offload lets batch more, a slow link on which the per-layer
round trip loses, and the prefill replica's steps slowed by the attention it carries."""
import numpy as np
import pytest

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import Plan, Workload
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model
from megainfer.perfmodel.sim.events import LengthDist, Requests, poisson_requests
from megainfer.perfmodel.sim.job import JobConfig
from megainfer.perfmodel.sim.pd import simulate_pd_job
from megainfer.perfmodel.sim.pd_offload import Offload, RemoteAttention
from perfmodel_helpers import TINY, synthetic_hw

HW = synthetic_hw(mem=4e7)
SLOW = synthetic_hw(mem=4e7, link_bw=1e6, latency=1e-3)  # 1 MB/s, 1 ms


def _setup(hw=HW, n_a=1, m=1, n_p=1):
    pool = PrefillPool(TINY, hw, n_p, 1)
    model = decode_model(TINY, hw, hw, Workload(64, 16), "bfloat16", True)
    return pool, model, Plan(1, n_a, 1, 2, m, n_a, hw.name, hw.name)


def _batch(r) -> float:
    return float(np.mean([x[2] for x in r.iteration_s]))


def _arrays(r):
    return [r.first_token_s, r.finish_s, r.kv_ready_s, np.array(r.iteration_s), np.array(r.prefill_steps)]


def _offline(n=32, prompt=64, out=32):
    return poisson_requests(n, float("inf"), LengthDist("fixed", prompt), LengthDist("fixed", out), seed=1)


def _stream(n=40):
    return poisson_requests(n, 2000.0, LengthDist("uniform", lo=16, hi=96),
                            LengthDist("uniform", lo=4, hi=24), seed=3)


@pytest.mark.parametrize("n_a,m,n_p,tok_s,iters", [(1, 1, 1, 31826.708397527436, 335),
                                                   (2, 2, 2, 31829.44821369848, 327)])
def test_ratio_zero_is_the_simulator_before_the_offload(n_a, m, n_p, tok_s, iters):
    """tok_s / iters: what this job gave before the offload existed (commit 13414ee)."""
    pool, model, plan = _setup(n_a=n_a, m=m, n_p=n_p)
    cfg = JobConfig(max_num_seqs=8)
    old = simulate_pd_job(pool, model, plan, _stream(), cfg)
    assert old.throughput_tok_s == pytest.approx(tok_s, rel=1e-9) and len(old.iteration_s) == iters
    for off in (Offload(0.0), Offload(0.0, pool_blocks=0), Offload(1.0, pool_blocks=0)):
        new = simulate_pd_job(pool, model, plan, _stream(), cfg, offload=off)
        assert not new.offloaded.any()
        for x, y in zip(_arrays(old), _arrays(new)):
            assert np.array_equal(x, y, equal_nan=True)


def test_ratio_half_offloads_every_other_request_in_hand_out_order():
    pool, model, plan = _setup()
    reqs = _stream()
    r = simulate_pd_job(pool, model, plan, reqs, JobConfig(max_num_seqs=8), offload=Offload(0.5))
    order = np.argsort(reqs.arrival_s, kind="stable")
    assert r.offloaded[order].tolist() == [k % 2 == 1 for k in range(len(reqs))]


def test_a_full_offload_pool_streams_the_kv():
    """Pool of 20 blocks of 16 tokens, each request 96 tokens (6 blocks) for its life: 3 at a
    time are offloaded, the others take the KV stream; a finished one gives its room back."""
    pool, model, plan = _setup()
    r = simulate_pd_job(pool, model, plan, _offline(n=16), JobConfig(max_num_seqs=8),
                        offload=Offload(1.0, pool_blocks=20))
    assert 3 <= r.offloaded.sum() < 16
    r0 = simulate_pd_job(pool, model, plan, _offline(n=16), JobConfig(max_num_seqs=8),
                         offload=Offload(1.0, pool_blocks=6 * 16))
    assert r0.offloaded.all()


def test_offloaded_kv_stays_ready_one_latency_after_the_first_token():
    pool, model, plan = _setup(hw=SLOW)
    r0 = simulate_pd_job(pool, model, plan, _offline(n=4), JobConfig())
    r1 = simulate_pd_job(pool, model, plan, _offline(n=4), JobConfig(), offload=Offload(1.0))
    assert np.allclose(r1.handoff_s, SLOW.inter_link.latency_s, rtol=1e-9)
    assert (r0.handoff_s > 10 * SLOW.inter_link.latency_s).all()  # the streamed KV on 1 MB/s


def test_one_offloaded_request_pays_the_round_trip_every_layer():
    """One request on a slow link: every decode iteration is at least L round trips (2
    latencies, q/k/v up and the output down with their headers at the link's bandwidth), and
    ``round_trip_s`` records each iteration's."""
    pool, model, plan = _setup(hw=SLOW)
    reqs = Requests(np.array([0.0]), np.array([64]), np.array([9]))
    r0 = simulate_pd_job(pool, model, plan, reqs, JobConfig())
    r1 = simulate_pd_job(pool, model, plan, reqs, JobConfig(), offload=Offload(1.0))
    o, s = Offload(1.0), TINY
    q, kv = s.num_heads * s.head_dim, 2 * s.num_kv_heads * s.head_dim
    wire = 2 * 1e-3 + ((q + kv) * 2 + o.header_up_B + q * 2 + o.header_down_B) / 1e6
    d0, d1 = [x[1] for x in r0.iteration_s], [x[1] for x in r1.iteration_s]
    assert len(d1) == len(d0) == 8
    assert min(d1) >= s.num_layers * wire
    assert max(d0) < s.num_layers * wire  # locally it is much shorter
    # one round trip per iteration recorded (one replica, one micro-batch), none without offload
    assert len(r1.round_trip_s) == 8 and r1.round_trip_s.min() >= wire and not len(r0.round_trip_s)


def test_remote_attention_grows_with_context_and_messages_queue_on_a_prefill_replica():
    pool, model, _ = _setup()
    ra = RemoteAttention(pool, model, 1e10, 1e-6, Offload(1.0))
    assert ra.attn_s(8, 4096) > ra.attn_s(8, 64) > 0 and ra.attn_s(0, 64) == 0
    n = np.zeros((2, 1, 1))
    n[:, 0, 0] = 4
    rt, used = ra.layer(n, n * 1000, np.zeros(1))
    one, _ = ra.layer(n[:1], n[:1] * 1000, np.zeros(1))
    assert rt[0, 0] > one[0, 0]  # two decode replicas' messages run one after the other
    assert used[0] == pytest.approx(2 * ra.attn_s(4, 1000))


def test_a_kv_limited_decode_pool_batches_more_with_offload():
    """Decode KV for 2 requests (200 tokens, 96 each): offload lifts the batch to what
    max_num_seqs allows; tokens/s rise with the ratio."""
    pool, model, plan = _setup()
    cfg = JobConfig(max_num_seqs=32)
    rs = [simulate_pd_job(pool, model, plan, _offline(), cfg, offload=Offload(x), decode_kv_tokens=200)
          for x in (0.0, 0.5, 1.0)]
    assert _batch(rs[0]) <= 2.0 < _batch(rs[1]) < _batch(rs[2])
    tps = [r.throughput_tok_s for r in rs]
    assert tps[0] < tps[1] < tps[2]
    assert tps[2] > 3 * tps[0]


def test_on_a_slow_link_the_round_trip_makes_offload_lose():
    pool, model, plan = _setup(hw=SLOW)
    cfg = JobConfig(max_num_seqs=32)
    r0 = simulate_pd_job(pool, model, plan, _offline(), cfg)
    r1 = simulate_pd_job(pool, model, plan, _offline(), cfg, offload=Offload(1.0))
    assert r1.throughput_tok_s < r0.throughput_tok_s
    assert np.median(r1.tpot_s) > np.median(r0.tpot_s)


def test_prefill_steps_take_longer_while_they_carry_offloaded_attention():
    """A stream of long prompts beside long decodes: the prefill replica answers every layer's
    offloaded attention, so its steps stretch; with ratio 0 they are the steps alone."""
    pool, model, plan = _setup()
    reqs = poisson_requests(24, 3000.0, LengthDist("fixed", 512), LengthDist("fixed", 64), seed=2)
    cfg = JobConfig(max_num_seqs=32)
    r0 = simulate_pd_job(pool, model, plan, reqs, cfg)
    r1 = simulate_pd_job(pool, model, plan, reqs, cfg, offload=Offload(1.0))
    d0 = np.array([x[2] for x in r0.prefill_steps])
    d1 = np.array([x[2] for x in r1.prefill_steps])
    assert d1.sum() > 1.02 * d0.sum()
    assert d1.max() > d0.max()


def test_decode_kv_limits_and_offload_config_are_checked():
    pool, model, plan = _setup()
    with pytest.raises(ConfigError, match="decode_kv_tokens"):
        simulate_pd_job(pool, model, plan, _offline(n=2), JobConfig(), decode_kv_tokens=50)
    # offloaded requests need no decode KV
    r = simulate_pd_job(pool, model, plan, _offline(n=2), JobConfig(), offload=Offload(1.0),
                        decode_kv_tokens=50)
    assert r.offloaded.all() and np.isfinite(r.finish_s).all()
    for bad in (dict(ratio=1.5), dict(ratio=-0.1), dict(pool_blocks=-1), dict(block_size=0)):
        with pytest.raises(ConfigError):
            Offload(**bad)


def test_offload_moves_the_kv_reads_to_the_prefill_replica():
    """Long contexts, a decode pool slow on memory and a prefill replica fast on it: with the
    rows' KV read there (the decode side computes their projections only) decode steps shorten."""
    dec = synthetic_hw(name="dec", bw=1e9, mem=4e8, link_bw=1e11, latency=1e-7)
    pre = synthetic_hw(name="pre", bw=1e12, mem=4e8, link_bw=1e11, latency=1e-7)
    pool = PrefillPool(TINY, pre, 1, 1)
    model = decode_model(TINY, dec, dec, Workload(2048, 16), "bfloat16", True)
    plan = Plan(1, 1, 1, 2, 1, 1, dec.name, dec.name)
    reqs = _offline(n=16, prompt=2048, out=16)
    r0 = simulate_pd_job(pool, model, plan, reqs, JobConfig(max_num_seqs=16, max_num_batched_tokens=4096))
    r1 = simulate_pd_job(pool, model, plan, reqs, JobConfig(max_num_seqs=16, max_num_batched_tokens=4096),
                         offload=Offload(1.0))
    assert np.median(r1.tpot_s) < 0.5 * np.median(r0.tpot_s)


def test_offloaded_decode_slows_monotonically_as_the_link_does():
    """Fully offloaded, a slower link (or a longer latency) never makes a decode step shorter."""
    tpot = []
    for bw, lat in [(1e11, 1e-7), (1e9, 1e-6), (1e7, 1e-5), (1e6, 1e-4)]:
        pool, model, plan = _setup(hw=synthetic_hw(mem=4e7, link_bw=bw, latency=lat))
        r = simulate_pd_job(pool, model, plan, _offline(n=8), JobConfig(), offload=Offload(1.0))
        tpot.append(float(np.median(r.tpot_s)))
    assert tpot == sorted(tpot) and tpot[-1] > 2 * tpot[0]


def test_auto_offloads_only_what_the_decode_kv_cannot_hold():
    """``policy="auto"`` (offload_rule.picks_auto) on a decode pool of 200 KV tokens (two
    96-token requests): with unlimited decode KV nothing is offloaded; with 200 tokens all but
    the first two, which fit locally, are (the pool is unlimited), and the batches grow as with
    ratio 1; a TPOT SLO below one round trip offloads none."""
    pool, model, plan = _setup()
    cfg = JobConfig(max_num_seqs=32)
    auto = Offload(0.0, policy="auto")
    r_inf = simulate_pd_job(pool, model, plan, _offline(), cfg, offload=auto)
    assert not r_inf.offloaded.any()
    r = simulate_pd_job(pool, model, plan, _offline(), cfg, offload=auto, decode_kv_tokens=200)
    assert r.offloaded.sum() == 30 and not r.offloaded[:2].any()
    r1 = simulate_pd_job(pool, model, plan, _offline(), cfg, offload=Offload(1.0), decode_kv_tokens=200)
    assert _batch(r) == pytest.approx(_batch(r1), rel=0.2)
    tight = Offload(0.0, policy="auto", tpot_slo_s=1e-9)
    rt = simulate_pd_job(pool, model, plan, _stream(), JobConfig(max_num_seqs=8), offload=tight,
                         decode_kv_tokens=200)
    assert not rt.offloaded.any()
    with pytest.raises(ConfigError, match="policy"):
        Offload(policy="adaptive")
    with pytest.raises(ConfigError, match="layer_wait"):
        Offload(layer_wait=2)


def test_a_short_pool_sends_a_decoding_request_home_for_a_newcomer():
    """Two seats, an 8-block pool of 16-token blocks: r0 (8 + 100 tokens, 7 blocks) is
    offloaded, r1 (8 + 20) finds the pool short before r0 decodes and stays local; r1 done, r2
    finds it short with r0 decoding: r0 goes home (its KV moved before the next iteration) and
    r2 is offloaded, as the runtime's ledger does. Without ``return_home`` nothing goes home
    and fewer are offloaded; every request finishes either way."""
    pool, model, plan = _setup()
    n = 6
    reqs = Requests(np.zeros(n), np.full(n, 8), np.array([100] + [20] * (n - 1)))
    cfg = JobConfig(max_num_seqs=2)
    r = simulate_pd_job(pool, model, plan, reqs, cfg, offload=Offload(1.0, pool_blocks=8))
    assert r.returned_home[0] and r.offloaded[0] and not r.offloaded[1] and r.offloaded[2]
    assert r.returned_home.sum() >= 1 and not (r.returned_home & ~r.offloaded).any()
    stay = simulate_pd_job(pool, model, plan, reqs, cfg,
                           offload=Offload(1.0, pool_blocks=8, return_home=False))
    assert not stay.returned_home.any() and stay.offloaded.sum() < r.offloaded.sum()
    for x in (r, stay):
        assert not np.isnan(x.finish_s).any()
