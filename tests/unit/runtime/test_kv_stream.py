"""Layer-wise KV streaming for prefill-decode disaggregation (docs/pd.md), in one process over
``MPI.COMM_SELF``: layers sent and received out of order, a delayed layer (a bounded wait that
names the rank, then completion), decode TP head slices, bf16 bytes, and quantised caches
(the sender's scales adopted, or the values requantised)."""
import pytest
import torch
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy
from megainfer.kernels import kv_quant
from megainfer.models.kv_spec import BLOCK_AXIS
from megainfer.runtime.control import RankFailure
from megainfer.runtime.pd.kv_place import sender_scales
from megainfer.models.kv_spec import kv_head_slice as head_slice
from megainfer.runtime.pd.kv_segments import Segments, gather_blocks
from megainfer.runtime.pd.kv_stream import Dest, KVReceiver, KVSender, OutgoingKV

BS, NB, L = 4, 12, 3
SEGS = Segments(2, 8)  # 2 blocks per segment: a 3-block transfer is 2 messages per layer


def _caches(kind: str, dtype=torch.float32, heads: int = 4):
    g = torch.Generator().manual_seed(5)
    shape = (2, NB, BS, heads, 8) if kind == "gqa" else (NB, BS, 24)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(L)]


def _stream(kind, src_caches, dst_shape, dtype, blocks, dst_blocks, n, heads=None,
            send_order=None, post_order=None, dst=None, parts=()):
    """Send one transfer through COMM_SELF with layers posted in ``send_order`` and receives
    posted in ``post_order``; returns the receiver's caches after the scatter."""
    comm = MPI.COMM_SELF.Dup()
    pol = WaitPolicy(timeout_s=5)
    tx = KVSender(comm, L, kind, "[prefill 0]", pol, SEGS, BS)
    rx = KVReceiver(comm, kind, dst_shape, dtype, L, "[attn dp0 tp0]", pol, SEGS, parts,
                    scaled=sender_scales(src_caches[0]) is not None)
    inc = rx.post(7, 0, len(blocks), "req", order=post_order)
    tx.begin(OutgoingKV(7, "req", [Dest(0, heads)], n), blocks, n, final=True)
    for l in (send_order or range(L)):
        tx.send_layer(l, src_caches[l])
    tx.end_step()
    rx.wait(inc)
    tx.drain()
    dst = dst or [torch.zeros(dst_shape, dtype=dtype) for _ in range(L)]
    rx.scatter(inc, dst, dst_blocks)
    comm.Free()
    return dst, tx


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_kv_stream_layers_out_of_order(kind):
    src = _caches(kind)
    blocks, dst_blocks, n = [5, 2, 9], [0, 7, 3], 10  # 10 tokens: the last block half full
    shape = tuple(src[0].shape)
    dst, tx = _stream(kind, src, shape, torch.float32, blocks, dst_blocks, n,
                      send_order=[2, 0, 1], post_order=[1, 2, 0])
    dim = BLOCK_AXIS[kind]
    for l in range(L):
        got = dst[l].index_select(dim, torch.tensor(dst_blocks))
        raw = src[l].index_select(dim, torch.tensor(blocks))
        tok = (lambda t: t.reshape(2, -1, *t.shape[3:])) if kind == "gqa" else \
            (lambda t: t.reshape(-1, t.shape[-1]))
        if kind == "gqa":
            assert torch.equal(tok(got)[:, :n], tok(raw)[:, :n]) and not tok(got)[:, n:].any()
        else:
            assert torch.equal(tok(got)[:n], tok(raw)[:n]) and not tok(got)[n:].any()
        assert torch.equal(got, gather_blocks(src[l], kind, blocks, n))
        untouched = [b for b in range(NB) if b not in dst_blocks]
        assert not dst[l].index_select(dim, torch.tensor(untouched)).any()
    assert tx.bytes_sent == L * 3 * BS * (2 * 4 * 8 if kind == "gqa" else 24) * 4


def test_kv_stream_head_slice_and_bf16():
    """A decode TP rank gets its own KV heads; bf16 travels as raw bytes."""
    src = _caches("gqa", torch.bfloat16, heads=4)
    first, count = head_slice(4, 2, 1)
    assert (first, count) == (2, 2)
    dst, _ = _stream("gqa", src, (2, NB, BS, 2, 8), torch.bfloat16, [1, 4], [6, 2], 8,
                     heads=(first, count))
    for l in range(L):
        got = dst[l].index_select(1, torch.tensor([6, 2]))
        assert torch.equal(got, src[l].index_select(1, torch.tensor([1, 4]))[:, :, :, 2:4])


def _quantised(kind, fmt, parts):
    """Source caches in ``fmt`` with their scales set from random values, and the values."""
    g = torch.Generator().manual_seed(9)
    caches, values = [], []
    for _ in range(L):
        if kind == "gqa":
            x = torch.randn(2, NB, BS, 2, 16, generator=g)
            sc = torch.zeros(2)
            kv_quant.update_scales(sc, fmt, x[0], x[1])
            q = torch.stack([kv_quant.quantize(x[i], sc[i], fmt).view(torch.uint8)
                             for i in range(2)]).view(kv_quant.storage_dtype(fmt, torch.float32))
        else:
            x = torch.randn(NB, BS, sum(parts), generator=g) * torch.tensor([1.0] * parts[0] +
                                                                             [4.0] * parts[1])
            sc = torch.zeros(2)
            a, b = x[..., :parts[0]], x[..., parts[0]:]
            kv_quant.update_scales(sc, fmt, a, b)
            q = torch.cat([kv_quant.quantize(a, sc[0], fmt).view(torch.uint8),
                           kv_quant.quantize(b, sc[1], fmt).view(torch.uint8)], -1).view(
                kv_quant.storage_dtype(fmt, torch.float32))
        kv_quant.register(q).copy_(sc)
        caches.append(q)
        values.append(x)
    return caches


def _dequant(kv, kind, fmt, parts):
    sc = kv_quant.scales_of(kv)
    if kind == "gqa":
        return torch.stack([kv_quant.dequantize(kv[i], sc[i], fmt, torch.float32) for i in range(2)])
    w = kv_quant.stored_dim(fmt, parts[0])
    return torch.cat([kv_quant.dequantize(kv[..., :w], sc[0], fmt, torch.float32),
                      kv_quant.dequantize(kv[..., w:], sc[1], fmt, torch.float32)], -1)


@pytest.mark.parametrize("kind,fmt", [("gqa", "fp8_e4m3"), ("mla", "fp4_e2m1"), ("mla", "fp8_e5m2")])
def test_quantised_kv_adopts_the_senders_scales_or_requantises(kind, fmt):
    """Unset scales: the sender's are adopted and the bytes placed as they are. Set and
    different: the values are requantised to this cache's scales (close to the sender's)."""
    parts = () if kind == "gqa" else (32, 16)
    src = _quantised(kind, fmt, parts)
    shape, dtype = tuple(src[0].shape), src[0].dtype
    blocks, dst_blocks, n = [1, 3], [4, 0], 8
    dim = BLOCK_AXIS[kind]
    fresh = [torch.zeros(shape, dtype=dtype) for _ in range(L)]
    for c in fresh:
        kv_quant.register(c)  # unset (zero) scales
    dst, tx = _stream(kind, src, shape, dtype, blocks, dst_blocks, n, parts=parts,
                      dst=fresh)
    assert tx.messages == 2 * L  # per layer: its one segment, then the layer's scales
    for l in range(L):
        assert torch.equal(kv_quant.scales_of(dst[l]), kv_quant.scales_of(src[l]))
        got = dst[l].view(torch.uint8).index_select(dim, torch.tensor(dst_blocks))
        assert torch.equal(got, src[l].view(torch.uint8).index_select(dim, torch.tensor(blocks)))
    other = []
    for l in range(L):  # a cache whose scales were set by an earlier, larger write
        c = torch.zeros(shape, dtype=dtype)
        kv_quant.register(c).copy_(kv_quant.scales_of(src[l]) * torch.tensor([1.5, 1.0]))
        other.append(c)
    dst, _ = _stream(kind, src, shape, dtype, blocks, dst_blocks, n, parts=parts, dst=other)
    for l in range(L):
        want = _dequant(src[l], kind, fmt, parts).index_select(dim, torch.tensor(blocks))
        got = _dequant(dst[l], kind, fmt, parts).index_select(dim, torch.tensor(dst_blocks))
        if kind == "gqa":
            want, got = want.reshape(2, -1, *want.shape[3:])[:, :n], got.reshape(2, -1, *got.shape[3:])[:, :n]
            assert torch.equal(got[1], want[1])  # values: same scale, bytes as they were
            err, ref = (got[0] - want[0]).abs().max(), want[0].abs().max()
        else:
            want, got = want.reshape(-1, want.shape[-1])[:n], got.reshape(-1, got.shape[-1])[:n]
            assert torch.equal(got[:, 32:], want[:, 32:])  # k_pe: same scale
            err, ref = (got[:, :32] - want[:, :32]).abs().max(), want[:, :32].abs().max()
        assert 0 < err <= ref * (0.25 if fmt.startswith("fp8") else 0.6)


def test_kv_stream_delayed_layer_waits_then_times_out_naming_the_rank():
    comm = MPI.COMM_SELF.Dup()
    src = _caches("mla")
    tx = KVSender(comm, L, "mla", "[prefill 0]", WaitPolicy(timeout_s=5), SEGS, BS)
    rx = KVReceiver(comm, "mla", tuple(src[0].shape), torch.float32, L, "[attn dp0 tp0]",
                    WaitPolicy(timeout_s=0.2), SEGS)
    inc = rx.post(3, 0, 2, "late")
    o = OutgoingKV(3, "late", [Dest(0, None)], 8)
    tx.begin(o, [0, 1], 8, final=True)  # layer 1 is delayed: only layers 0 and 2 go now
    tx.send_layer(0, src[0])
    tx.send_layer(2, src[2])
    assert not inc.test()
    with pytest.raises(RankFailure, match=r"rank 0 .*KV transfer of request 'late'.*2 of 3"):
        rx.wait(inc)
    tx.send_layer(1, src[1])  # the delayed layer arrives: the transfer completes
    tx.end_step()
    rx.wait(inc)
    tx.drain()
    comm.Free()


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_chunked_prompt_streams_each_segment_in_the_step_that_completes_it(kind):
    """18 tokens in 5 blocks = 3 segments of 2 blocks: chunks ending at 9, 10, 17 and 18
    tokens post segment 0, nothing, segment 1, then segment 2 (the partial block) with the
    prompt's last step; the receive completes only then, and the blocks are whole."""
    comm = MPI.COMM_SELF.Dup()
    src = _caches(kind)
    pol = WaitPolicy(timeout_s=5)
    tx = KVSender(comm, L, kind, "[prefill 0]", pol, SEGS, BS)
    rx = KVReceiver(comm, kind, tuple(src[0].shape), torch.float32, L, "[attn dp0 tp0]", pol,
                    SEGS)
    blocks, dst_blocks, n = [3, 7, 1, 10, 4], [0, 2, 5, 8, 11], 18
    inc = rx.post(1, 0, len(blocks), "chunked")
    o = OutgoingKV(1, "chunked", [Dest(0, None)], n)
    posted = []
    for computed, final in ((9, False), (10, False), (17, False), (18, True)):
        tx.begin(o, blocks, computed, final)
        posted.append(list(o.step_segs))
        for l in range(L):
            tx.send_layer(l, src[l])
        tx.end_step()
        assert inc.test() == final
    assert posted == [[0], [], [1], [2]]
    rx.wait(inc)
    tx.drain()
    dst = [torch.zeros_like(src[0]) for _ in range(L)]
    rx.scatter(inc, dst, dst_blocks)
    dim = BLOCK_AXIS[kind]
    for l in range(L):
        got = dst[l].index_select(dim, torch.tensor(dst_blocks))
        assert torch.equal(got, gather_blocks(src[l], kind, blocks, n))
    comm.Free()


@pytest.mark.parametrize("kind,fmt", [("gqa", "fp8_e4m3"), ("gqa", "fp4_e2m1"),
                                      ("mla", "fp8_e5m2"), ("mla", "fp4_e2m1")])
def test_token_head_kv_travels_verbatim(kind, fmt):
    """token_head caches (each row's scale inline): the rows arrive byte for byte, whatever
    the decode cache's per-layer scales hold (they are never read, set or requantised to)."""
    from megainfer.models.kv_spec import KVCacheSpec
    parts = (32, 16)
    spec = (KVCacheSpec("gqa", (2, 2, 16), torch.float32, L, fmt, kv_granularity="token_head")
            if kind == "gqa" else
            KVCacheSpec("mla", (48,), torch.float32, L, fmt, parts, "token_head"))
    g = torch.Generator().manual_seed(9)
    src = spec.allocate(NB, BS)
    for c in src:
        if kind == "gqa":
            x = torch.randn(2, NB, BS, 2, 16, generator=g) * 10 ** torch.randint(-3, 3, (2, NB, BS, 2, 1), generator=g)
            c.copy_(kv_quant.quantize(x, None, fmt, "token_head"))
        else:
            x = torch.randn(NB, BS, 48, generator=g)
            c.copy_(torch.cat([kv_quant.quantize(x[..., :32], None, fmt, "token_head"),
                               kv_quant.quantize(x[..., 32:], None, fmt, "token_head")], -1))
    dst = spec.allocate(NB, BS)
    for c in dst:
        kv_quant.scales_of(c).fill_(3.0)  # would requantise a tensor-scale cache
    shape, dtype = tuple(src[0].shape), src[0].dtype
    blocks, dst_blocks = [1, 3], [4, 0]
    dim = BLOCK_AXIS[kind]
    dst, tx = _stream(kind, src, shape, dtype, blocks, dst_blocks, 8, parts=parts if kind == "mla"
                      else (), dst=dst)
    assert tx.messages == L  # one segment per layer, no per-layer scales on the wire
    for l in range(L):
        got = dst[l].view(torch.uint8).index_select(dim, torch.tensor(dst_blocks))
        assert torch.equal(got, src[l].view(torch.uint8).index_select(dim, torch.tensor(blocks)))
        assert torch.equal(kv_quant.scales_of(dst[l]), torch.full((2,), 3.0))
