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
from megainfer.engine.step import StepInput

POLICY = WaitPolicy(timeout_s=5)


def test_config_validates_naming_the_field():
    assert PdConfig().pool_blocks(100) == 0  # off by default: no pool
    assert PdConfig(offload=True).pool_blocks(100) == 50
    assert PdConfig(offload=True, offload_blocks=7).pool_blocks(100) == 7
    for kw, name in ((dict(offload="yes"), "pd.offload"), (dict(offload_ratio=1.5), "pd.offload_ratio"),
                     (dict(offload_ratio=-0.1), "pd.offload_ratio"),
                     (dict(offload_blocks=0), "pd.offload_blocks"),
                     (dict(offload_policy="adaptive"), "pd.offload_policy")):
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
    holding all four, and the pool holds each one's new keys/values."""
    torch.manual_seed(0)
    Hq, Hkv, D, bs, L = 4, 2, 8, 4, 2
    spec = KVCacheSpec("gqa", (2, Hkv, D), num_layers=L)
    ref_kv = spec.allocate(32, bs, "cpu", torch.float32)
    prefill_kv = spec.allocate(16, bs, "cpu", torch.float32)
    engine = SimpleNamespace(cache_config=SimpleNamespace(block_size=bs), kv_spec=spec,
                             device=torch.device("cpu"), kv_caches=prefill_kv)
    model = SimpleNamespace(layers=[SimpleNamespace(self_attn=SimpleNamespace(
        attn_backend=TorchAttention(), scale=D ** -0.5)) for _ in range(L)])
    pool = OffloadPool(engine, model, 16, MPI.COMM_SELF, "[prefill 0]", POLICY)
    client = OffloadClient(MPI.COMM_SELF, "[attn dp0 tp0]", POLICY, torch.device("cpu"))
    ctx = [5, 9, 2, 13]
    ref_tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    local_bm, dec_tables = BlockManager(32, bs), {}
    for i, c in enumerate(ctx):  # the prompts' KV: in the reference cache, and where it lives
        kv = torch.randn(L, 2, c, Hkv, D)
        for l in range(L):
            for t in range(c):
                ref_kv[l][:, ref_tables[i][t // bs], t % bs] = kv[l, :, t]
        req = Request(i, f"r{i}", None, list(range(c)), SamplingParams(), seed=0)
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
    for i in (1, 3):
        client.release(i)
    pool.drain(within_s=1.0)
    assert not pool.held and pool.blocks.num_free_blocks == 16
    client.outbox.flush()
    assert not math.isnan(client.trips.total_s)
