"""Decode attention offload's pieces in one process (``pd.offload``, docs/pd.md): the config,
rank 0's ledger, the decode engine's block manager for offloaded sequences (finish and
preemption release them; a preempted one comes home) and the per-layer exchange itself, over
``COMM_SELF`` (the decode rank's messages go to itself and an ``OffloadPool`` in the same
process answers them): offloaded rows attended on the pool give what attention over one cache
holding every sequence gives. Under mpiexec: tests/distributed/test_pd_offload.py."""
import math
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy
from megainfer.config import ConfigError, PdConfig
from megainfer.engine.block_manager import BlockManager
from megainfer.engine.request import Request
from megainfer.engine.sampling_params import SamplingParams
from megainfer.models.attention import AttentionMetadata
from megainfer.models.attention_backends import TorchAttention
from megainfer.models.kv_spec import KVCacheSpec
from megainfer.runtime import tags
from megainfer.runtime.messages import OffloadRelease
from megainfer.runtime.pd.offload_decode import OffloadClient, OffloadedAttention, RemoteKVBlocks
from megainfer.runtime.pd.offload_policy import OffloadLedger
from megainfer.runtime.pd.offload_pool import OffloadPool
from megainfer.runtime.pd.kv_segments import Segments
from megainfer.runtime.pd.kv_stream import KVReceiver
from megainfer.runtime.pd.offload_home import bring_home
from megainfer.engine.step import StepInput

POLICY = WaitPolicy(timeout_s=5)
SEGS = Segments.for_job(64, 4, 32)


def test_config_validates_naming_the_field():
    assert PdConfig().pool_blocks(100) == 0  # off by default: no pool
    assert PdConfig(offload=True).pool_blocks(100) == 50
    assert PdConfig(offload=True, offload_blocks=7).pool_blocks(100) == 7
    for kw, name in ((dict(offload="yes"), "pd.offload"), (dict(offload_ratio=1.5), "pd.offload_ratio"),
                     (dict(offload_ratio=-0.1), "pd.offload_ratio"),
                     (dict(offload_blocks=0), "pd.offload_blocks"),
                     (dict(offload_policy="adaptive"), "pd.offload_policy"),
                     (dict(offload_return_home=1), "pd.offload_return_home")):
        with pytest.raises(ConfigError, match=name):
            PdConfig(**kw)


def _inp(n=1, max_tokens=12, prompt_logprobs=None):
    return SimpleNamespace(params=SimpleNamespace(n=n, max_tokens=max_tokens,
                                                  prompt_logprobs=prompt_logprobs))


@pytest.mark.parametrize("ratio,want", [(0, 0), (0.5, 5), (1, 10), (0.3, 3)])
def test_ledger_offloads_the_fraction(ratio, want):
    led = OffloadLedger(ratio, 1000, 1, 4, 128)
    picks = [led.decide(0, 0, x, _inp(), 10) for x in range(10)]
    assert sum(t > 0 for t in picks) == want == led.offloaded
    assert all(t in (0, 22) for t in picks)  # prompt + max_tokens, reserved up front


def test_ledger_room_credits_and_ineligible_requests():
    led = OffloadLedger(1, 10, 2, 4, 64)
    assert led.decide(0, 0, 0, _inp(n=2), 8) == 0  # n > 1: forks share blocks, not offloaded
    assert led.decide(0, 0, 1, _inp(prompt_logprobs=1), 8) == 0
    assert led.decide(0, 0, 2, _inp(max_tokens=None), 8) == 0  # max_model_len: 16 blocks, no room
    assert led.no_room == 1 and led.free == [10, 10]
    assert led.decide(0, 0, 3, _inp(max_tokens=20), 8) == 28  # 7 blocks
    assert led.decide(0, 0, 4, _inp(max_tokens=20), 8) == 0 and led.free == [3, 10]  # no room
    assert led.decide(1, 0, 5, _inp(max_tokens=20), 8) == 28  # the other prefill rank has room
    led.decoding("r3", 3)
    led.finished("r3")  # its output reached rank 0
    led.credit(5)  # dropped at the prefill rank
    assert led.free == [10, 10] and not led.held


def test_ledger_auto_offloads_only_under_decode_kv_pressure_while_the_pool_has_room():
    """``pd.offload_policy=auto``, decode replicas of 64 KV tokens, a pool of 14 blocks of 4:
    each request lives 20 tokens (5 blocks). Three fit locally on replica 0, the fourth would
    not: offloaded, as the fifth; the sixth finds the pool full and stays local (it waits);
    replica 1 has room, so its request stays local; a local one finishing relieves the pressure."""
    led = OffloadLedger(0.0, 14, 1, 4, 128, policy="auto", num_decode=2, decode_kv_tokens=64)
    picks = [led.decide(0, 0, x, _inp(max_tokens=12), 8) for x in range(6)]
    assert picks == [0, 0, 0, 20, 20, 0] and led.local == [80, 0] and led.free == [4]
    assert led.decide(0, 1, 6, _inp(max_tokens=12), 8) == 0 and led.local == [80, 20]
    for x in (0, 1):
        led.decoding(f"r{x}", x)
        led.finished(f"r{x}")  # two local ones done on replica 0: 40 tokens free there
    led.credit(3)  # an offloaded one dropped: its pool room back
    assert led.local == [40, 20] and led.free == [9]
    assert led.decide(0, 0, 7, _inp(max_tokens=12), 8) == 0  # fits locally again: no pressure
    auto_off = OffloadLedger(1.0, 14, 1, 4, 128, policy="auto", num_decode=1, decode_kv_tokens=None)
    assert led.decide(0, 0, 8, _inp(n=2), 8) == 0  # n > 1 never
    assert auto_off.decide(0, 0, 0, _inp(max_tokens=12), 8) == 0  # unlimited decode KV: no pressure


def test_ledger_sends_decoding_requests_home_for_the_room():
    """A pool of 12 blocks of 4 holds two 20-token lives (5 blocks each); a third request the
    ratio offloads finds it short: the oldest one decoding from that pool is sent home (its
    decode replica's KV holds it), its room goes to the newcomer, the ledger counts it local
    from then on. Not decoding yet, or a decode replica without room, or
    ``return_home=False``: nothing goes home and the newcomer stays local."""
    led = OffloadLedger(1.0, 12, 1, 4, 128, num_decode=2, decode_kv_tokens=64)
    assert [led.decide(0, x % 2, x, _inp(max_tokens=12), 8) for x in range(3)] == [20, 20, 0]
    assert led.no_room == 1 and not led.take_homes()  # none decoding: none can go home
    led.decoding("r0", 0)
    led.decoding("r1", 1)
    assert led.decide(0, 1, 3, _inp(max_tokens=12), 8) == 20
    assert led.take_homes() == [(0, 0)] and led.sent_home == 1 and led.take_homes() == []
    assert led.free == [2] and led.local == [40, 0] and not led.is_offloaded(0)  # r2 and r0
    led.finished("r0")  # home and done: its decode replica's KV back
    assert led.local == [20, 0] and led.free == [2]
    full = OffloadLedger(1.0, 5, 1, 4, 128, num_decode=1, decode_kv_tokens=16)
    assert full.decide(0, 0, 0, _inp(max_tokens=12), 8) == 20
    full.decoding("r0", 0)
    assert full.decide(0, 0, 1, _inp(max_tokens=12), 8) == 0  # 20 tokens do not fit 16 there
    assert not full.take_homes() and full.no_room == 1
    off = OffloadLedger(1.0, 5, 1, 4, 128, num_decode=1, decode_kv_tokens=64, return_home=False)
    assert off.decide(0, 0, 0, _inp(max_tokens=12), 8) == 20
    off.decoding("r0", 0)
    assert off.decide(0, 0, 1, _inp(max_tokens=12), 8) == 0 and not off.take_homes()


def test_ledger_auto_keeps_the_tpot_slo_by_its_prediction():
    """``auto`` with a 50 ms TPOT SLO over 4 layers: no prediction yet (nothing measured),
    offloaded under pressure; a 30 ms iteration with 2 ms round trips predicts 38 ms (kept);
    with 6 ms round trips 54 ms: the request stays local (counted in ``over_tpot``)."""
    led = OffloadLedger(0.0, 100, 1, 4, 128, policy="auto", decode_kv_tokens=10,
                        tpot_slo_s=0.05, num_layers=4)
    assert led.predicted_tpot_s() is None
    assert led.decide(0, 0, 0, _inp(max_tokens=12), 8) == 20
    led.observe(0.030, ())
    assert led.predicted_tpot_s() is None  # no round trip measured yet
    led.observe(0.030, (0.002, 0.002))
    assert led.predicted_tpot_s() == pytest.approx(0.038)
    assert led.decide(0, 0, 1, _inp(max_tokens=12), 8) == 20
    led.observe(0.030, (0.006,))
    assert led.decide(0, 0, 2, _inp(max_tokens=12), 8) == 0 and led.over_tpot == 1


def test_ledger_auto_offloads_only_while_the_prefill_rank_has_spare_time():
    """``auto`` with ``max_prefill_busy=0.5``: before two reports no measurement (offloaded
    under pressure); reports 0.2 s apart with 0.18 s more busy: 90% busy, the request stays
    local (``no_spare``); half a second later with no report (idle since): 0.18 of 0.7 s
    busy, offloaded again; the window forgets reports older than a second."""
    led = OffloadLedger(0.0, 100, 1, 4, 128, policy="auto", decode_kv_tokens=10,
                        max_prefill_busy=0.5)
    led.prefill_busy(0, 1.0, 10.0)
    assert led.busy_fraction(0, 10.1) is None
    assert led.decide(0, 0, 0, _inp(max_tokens=12), 8, now=10.1) == 20
    led.prefill_busy(0, 1.18, 10.2)
    assert led.busy_fraction(0, 10.2) == pytest.approx(0.9)
    assert led.decide(0, 0, 1, _inp(max_tokens=12), 8, now=10.2) == 0 and led.no_spare == 1
    assert led.busy_fraction(0, 10.7) == pytest.approx(0.18 / 0.7)
    assert led.decide(0, 0, 2, _inp(max_tokens=12), 8, now=10.7) == 20
    for i, t in enumerate((10.4, 10.6, 11.3, 11.5)):
        led.prefill_busy(0, 1.2 + 0.01 * i, t)
    assert [x[0] for x in led.busy[0]] == [10.4, 10.6, 11.3, 11.5]  # 10.4: the window's start
    assert led.busy_fraction(0, 11.5) == pytest.approx(0.03 / 1.1)
    with pytest.raises(ConfigError, match="pd.offload_max_prefill_busy"):
        PdConfig(offload_max_prefill_busy=0)


def test_remote_blocks_release_on_finish_and_come_home_on_preemption():
    client = OffloadClient(MPI.COMM_SELF, "[attn dp0 tp0]", POLICY, torch.device("cpu"))
    blocks = RemoteKVBlocks(BlockManager(8, 4), client)
    off = Request(7, "a", None, list(range(10)), SamplingParams(), seed=0)
    local = Request(8, "b", None, list(range(10)), SamplingParams(), seed=0)
    client.adopt(off, 0, 41)
    assert blocks.allocate(off, 30) and off.block_table == []  # nothing held here
    assert blocks.allocate(local, 10) and len(local.block_table) == 3
    assert blocks.num_free_blocks == 5
    blocks.free_request(off)  # preempted (or finished): its prefill rank frees its blocks
    msg = MPI.COMM_SELF.recv(source=0, tag=tags.OFFLOAD_QKV)
    assert isinstance(msg, OffloadRelease) and msg.xfers == [41]
    assert client.num_offloaded == 0 and client.returned == 0
    assert blocks.allocate(off, 11) and len(off.block_table) == 3  # recomputed here: local
    assert client.returned == 1
    blocks.free_request(off)
    blocks.free_request(local)
    assert blocks.num_free_blocks == 8
    assert not MPI.COMM_SELF.Iprobe(source=0, tag=tags.OFFLOAD_QKV)  # local: no release
    client.outbox.flush()


class _ServingFirst:
    """The decode rank's local attention, but the prefill side (same process) answers first."""

    name = "torch"

    def __init__(self, pool):
        self.pool, self.inner = pool, TorchAttention()

    def __call__(self, *args):
        self.pool.serve()
        return self.inner(*args)


def test_offloaded_rows_attend_as_one_cache():
    """4 decoding sequences (contexts 5, 9, 2, 13), sequences 1 and 3 offloaded: their prompts'
    KV sits in the pool (copied from the prefill engine's blocks by ``keep``), two decode steps
    through ``OffloadedAttention`` give the outputs plain attention gives over one cache
    holding all four, and the pool holds each one's new keys/values; sequence 1 then comes
    home (its KV, prompt and decoded tokens, in the decode rank's blocks, its pool blocks
    freed) and a third step, 1 local and 3 still offloaded, gives plain attention's outputs."""
    torch.manual_seed(0)
    Hq, Hkv, D, bs, L = 4, 2, 8, 4, 2
    spec = KVCacheSpec("gqa", (2, Hkv, D), num_layers=L)
    ref_kv = spec.allocate(32, bs, "cpu", torch.float32)
    prefill_kv = spec.allocate(16, bs, "cpu", torch.float32)
    engine = SimpleNamespace(cache_config=SimpleNamespace(block_size=bs), kv_spec=spec,
                             device=torch.device("cpu"), kv_caches=prefill_kv)
    model = SimpleNamespace(layers=[SimpleNamespace(self_attn=SimpleNamespace(
        attn_backend=TorchAttention(), scale=D ** -0.5)) for _ in range(L)])
    pool = OffloadPool(engine, model, 16, MPI.COMM_SELF, "[prefill 0]", POLICY, SEGS)
    client = OffloadClient(MPI.COMM_SELF, "[attn dp0 tp0]", POLICY, torch.device("cpu"))
    ctx = [5, 9, 2, 13]
    ref_tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    local_bm, dec_tables, reqs = BlockManager(32, bs), {}, {}
    for i, c in enumerate(ctx):  # the prompts' KV: in the reference cache, and where it lives
        kv = torch.randn(L, 2, c, Hkv, D)
        for l in range(L):
            for t in range(c):
                ref_kv[l][:, ref_tables[i][t // bs], t % bs] = kv[l, :, t]
        req = reqs[i] = Request(i, f"r{i}", None, list(range(c)), SamplingParams(), seed=0)
        if i in (1, 3):  # prefilled on the prefill rank, kept there for its life
            pbm = BlockManager(16, bs)
            holder = Request(-1, "p", None, list(range(c)), SamplingParams(), seed=0)
            pbm.allocate(holder, c)
            for l in range(L):
                for t in range(c):
                    prefill_kv[l][:, holder.block_table[t // bs], t % bs] = kv[l, :, t]
            pool.keep(100 + i, SimpleNamespace(block_table=holder.block_table,
                                               num_prompt_tokens=c, request_id=f"r{i}"), c + 4)
            client.adopt(req, 0, 100 + i)
            dec_tables[i] = []
        else:
            local_bm.allocate(req, c + 4)
            dec_tables[i] = list(req.block_table)
    dec_kv = spec.allocate(32, bs, "cpu", torch.float32)  # the decode rank's own cache
    for i in (0, 2):
        for l in range(L):
            for t in range(ctx[i]):
                dec_kv[l][:, dec_tables[i][t // bs], t % bs] = ref_kv[l][:, ref_tables[i][t // bs], t % bs]
    backends = [OffloadedAttention(_ServingFirst(pool), l, client) for l in range(L)]
    for step in range(2):
        c = [x + step for x in ctx]
        part = StepInput(seq_ids=[0, 1, 2, 3], query_lens=[1] * 4, context_lens=c,
                         block_tables=[dec_tables[i] for i in range(4)],
                         input_ids=torch.zeros(4, dtype=torch.long),
                         positions=torch.tensor(c), sample_rows=[0, 1, 2, 3])
        meta, _, _ = client.metadata(part, bs, torch.device("cpu"))
        ref_meta = AttentionMetadata.build([1] * 4, c, ref_tables, bs)
        for l in range(L):
            q, k, v = torch.randn(4, Hq, D), torch.randn(4, Hkv, D), torch.randn(4, Hkv, D)
            want = TorchAttention()(q, k, v, ref_kv[l], ref_meta, D ** -0.5)
            got = backends[l](q, k, v, dec_kv[l], meta, D ** -0.5)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert client.trips.count == 2 * L and pool.served == 2 * L  # one message per layer
    # sequence 1 comes home: its 11 tokens' KV from the pool into blocks of the decode rank's
    # own cache (bring_home over the KV stream's receiver; the pool answers in the same process)
    home = reqs[1]
    home.num_computed_tokens = ctx[1] + 2
    blocks = RemoteKVBlocks(local_bm, client)
    engine_d = SimpleNamespace(scheduler=SimpleNamespace(running=[home]), blocks=blocks,
                               cache_config=SimpleNamespace(block_size=bs), kv_caches=dec_kv)
    receiver = KVReceiver(MPI.COMM_SELF, "gqa", tuple(dec_kv[0].shape), torch.float32, L,
                          "[attn dp0 tp0]", POLICY, SEGS)
    receiver.wait = lambda inc: (pool.serve(), KVReceiver.wait(receiver, inc))
    assert bring_home(engine_d, client, receiver, 101) is True
    assert client.num_offloaded == 1 and client.homed == 1 and 101 not in pool.held
    assert len(home.block_table) == 3 and pool.home.returned == 1
    for l in range(L):
        for t in range(ctx[1] + 2):
            torch.testing.assert_close(dec_kv[l][:, home.block_table[t // bs], t % bs],
                                       ref_kv[l][:, ref_tables[1][t // bs], t % bs])
    assert bring_home(engine_d, client, receiver, 101) is None  # not offloaded any more
    dec_tables[1] = home.block_table
    local_bm.allocate(home, ctx[1] + 3)
    c = [x + 2 for x in ctx]  # a third step: sequence 1 attends here, 3 still on the pool
    part = StepInput(seq_ids=[0, 1, 2, 3], query_lens=[1] * 4, context_lens=c,
                     block_tables=[dec_tables[i] for i in range(4)],
                     input_ids=torch.zeros(4, dtype=torch.long), positions=torch.tensor(c),
                     sample_rows=[0, 1, 2, 3])
    meta, _, _ = client.metadata(part, bs, torch.device("cpu"))
    ref_meta = AttentionMetadata.build([1] * 4, c, ref_tables, bs)
    for l in range(L):
        q, k, v = torch.randn(4, Hq, D), torch.randn(4, Hkv, D), torch.randn(4, Hkv, D)
        want = TorchAttention()(q, k, v, ref_kv[l], ref_meta, D ** -0.5)
        torch.testing.assert_close(backends[l](q, k, v, dec_kv[l], meta, D ** -0.5), want,
                                   rtol=1e-5, atol=1e-6)
    client.release(3)
    pool.drain(within_s=1.0)
    assert not pool.held and pool.blocks.num_free_blocks == 16
    client.outbox.flush()
    assert not math.isnan(client.trips.total_s)
