"""Paged-attention Triton kernels (interpreter, TRITON_INTERPRET=1, or a GPU) against the torch
references in kernels/attention_ref.py and the model's torch path (models/attention.py)."""
import os

import pytest
import torch

from megainfer.kernels.attention_ref import (check_attention_args, decode_attention_ref,
                                             prefill_attention_ref, store_kv_ref,
                                             supported_head_dim)
from megainfer.kernels.dispatch import KernelInputError

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton needs a GPU or TRITON_INTERPRET=1")
# compiled for real on a GPU (TRITON_INTERPRET unset or 0): inputs are built on the CPU, moved
# there for the Triton call, and outputs come back to be compared with the references
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# (cached context, new tokens) per sequence: no context, decode row, chunk at a cached prefix,
# a chunk ending exactly on a block boundary of 8/16/32 (64 = 61 + 3)
MIXED = [(0, 9), (13, 1), (21, 17), (61, 3)]


def ta():
    from megainfer.kernels import triton_attention
    return triton_attention


def make_cache(seq_lens, Hkv, D, BS, dtype, seed, width=None, index=torch.int32):
    """Cache with random K/V on each sequence's live slots and NaN everywhere else (unused
    slots of a last block, spare blocks, and the block that padding table entries point at):
    reading anything past seq_len poisons the output. -> kv_cache, block_tables [S, width]."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in seq_lens]
    NB = sum(need) + 2
    width = max(max(need, default=1), 1) if width is None else width
    cache = torch.full((2, NB, BS, Hkv, D), float("nan"), dtype=dtype)
    ids = torch.randperm(NB - 1, generator=g) + 1  # block 0: the NaN block padding points at
    table = torch.zeros(len(seq_lens), width, dtype=index)
    k = 0
    for s, n in enumerate(seq_lens):
        table[s, :need[s]] = ids[k:k + need[s]]
        k += need[s]
        pos = torch.arange(n)
        blk = table[s].long()[pos // BS]
        cache[:, blk, pos % BS] = torch.randn(2, n, Hkv, D, generator=g).to(dtype)
    return cache, table


def prefill_case(pairs, Hq, Hkv, D, BS, dtype=torch.float32, seed=0, index=torch.int32):
    seq_lens = [c + n for c, n in pairs]
    cache, table = make_cache(seq_lens, Hkv, D, BS, dtype, seed, index=index)
    qlens = torch.tensor([n for _, n in pairs])
    qsl = torch.zeros(len(pairs) + 1, dtype=torch.int64)
    qsl[1:] = qlens.cumsum(0)
    q = torch.randn(int(qsl[-1]), Hq, D, generator=torch.Generator().manual_seed(seed + 1))
    return q.to(dtype), cache, qsl, torch.tensor(seq_lens), table, max(n for _, n in pairs)


def run_prefill(q, cache, qsl, sl, table, maxq, scale, **kw):
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return ta().prefill_attention(to(q), to(cache), to(qsl), to(sl), to(table), maxq, scale,
                                  **kw).cpu()


def run_decode(q, cache, sl, table, scale, **kw):
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return ta().decode_attention(to(q), to(cache), to(sl), to(table), scale, **kw).cpu()


def close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


GQA = [(4, 4), (4, 2), (8, 2), (3, 1)]  # (Hq, Hkv): groups 1, 2, 4 and 3 with one kv head


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("D", [16, 48, 80, 128])
def test_prefill_matches_ref(heads, D):
    BS = (8, 16, 32)[(heads[0] + D) % 3]
    index = torch.int32 if D % 32 else torch.int64
    args = prefill_case(MIXED, *heads, D, BS, seed=D + heads[0], index=index)
    out = run_prefill(*args, D ** -0.5)
    close(out, prefill_attention_ref(*args, D ** -0.5), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("BS", [8, 32])
def test_prefill_half_dtypes(dtype, BS):
    args = prefill_case(MIXED, 8, 2, 64, BS, dtype=dtype, seed=BS)
    out = run_prefill(*args, 0.125)
    assert out.dtype == dtype
    close(out, prefill_attention_ref(*args, 0.125), dtype)


def test_prefill_head_dim_256_and_odd_block_size():
    """D = 256, and a block size that is not a power of two (the kernel gathers per position)."""
    args = prefill_case([(5, 7), (0, 2)], 2, 1, 256, 16, seed=3)
    close(run_prefill(*args, 0.0625), prefill_attention_ref(*args, 0.0625), torch.float32)
    args = prefill_case([(11, 4), (0, 1)], 4, 2, 32, 12, seed=4)
    close(run_prefill(*args, 0.2), prefill_attention_ref(*args, 0.2), torch.float32)


def test_prefill_empty_sequence_strided_q_and_out():
    """A sequence with no new tokens, q a strided view of a fused qkv, results into out=."""
    q, cache, qsl, sl, table, maxq = prefill_case([(7, 5), (4, 0), (0, 1)], 4, 2, 48, 8, seed=5)
    qkv = torch.cat([q, torch.randn(q.shape[0], 4, 48)], 1)  # [T, 2*Hq, D]
    out = torch.full((q.shape[0], 4, 48), 7.0, device=DEVICE)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    got = ta().prefill_attention(to(qkv)[:, :4], to(cache), to(qsl), to(sl), to(table), maxq,
                                 0.3, out=out)
    assert got is out
    close(out.cpu(), prefill_attention_ref(q, cache, qsl, sl, table, maxq, 0.3), torch.float32)


DECODE_LENS = [0, 1, 8, 16, 33, 64, 70]  # a padded row, block boundaries of 8/16/32, ragged


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("D,BS,splits", [(16, 8, 3), (48, 16, 1), (80, 32, 3), (128, 16, 2)])
def test_decode_matches_ref(heads, D, BS, splits):
    Hq, Hkv = heads
    cache, table = make_cache(DECODE_LENS, Hkv, D, BS, torch.float32, seed=D + Hq,
                              index=torch.int64 if splits == 1 else torch.int32)
    q = torch.randn(len(DECODE_LENS), Hq, D)
    sl = torch.tensor(DECODE_LENS)
    out = run_decode(q, cache, sl, table, D ** -0.5, num_splits=splits)
    close(out, decode_attention_ref(q, cache, sl, table, D ** -0.5), torch.float32)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # seq_len 0: zeros, not NaN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("splits", [None, 4])
def test_decode_half_dtypes_and_default_splits(dtype, splits):
    lens = [0, 32, 45]
    cache, table = make_cache(lens, 2, 96, 32, dtype, seed=7, width=4)
    q = torch.randn(3, 8, 96).to(dtype)
    out = run_decode(q, cache, torch.tensor(lens), table, 0.1, num_splits=splits)
    close(out, decode_attention_ref(q, cache, torch.tensor(lens), table, 0.1), dtype)


def test_decode_more_splits_than_keys_and_d256():
    """Empty splits (8 splits over 1-9 keys) merge to the same answer; D = 256, group 8."""
    lens = [1, 9, 0]
    cache, table = make_cache(lens, 1, 256, 8, torch.float32, seed=8, width=3)
    q = torch.randn(3, 8, 256)
    ref = decode_attention_ref(q, cache, torch.tensor(lens), table, 0.05)
    for splits in (1, 8):
        close(run_decode(q, cache, torch.tensor(lens), table, 0.05, num_splits=splits), ref,
              torch.float32)


def test_num_splits_uses_host_info_only():
    f = ta().choose_num_splits
    assert f(1, 1, 1, 16, torch.device("cpu")) == 1  # 16 keys: nothing to split
    assert f(1, 1, 128, 16, torch.device("cpu")) > 1  # one long sequence: split it
    assert f(64, 8, 128, 16, torch.device("cpu")) == 1  # many programs already
    assert 1 <= f(4, 2, 1000, 32, torch.device("cpu")) <= 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("index", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_store_kv_matches_ref_and_skips_padding(dtype, index):
    g = torch.Generator().manual_seed(9)
    cache = torch.randn(2, 6, 8, 2, 40, generator=g).to(dtype)
    k, v = (torch.randn(7, 2, 40, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([3, -1, 17, 47, -1, 8, 0], dtype=index)
    want = cache.clone()
    store_kv_ref(k, v, want, slots)
    got = cache.to(DEVICE)
    ta().store_kv(k.to(DEVICE), v.to(DEVICE), got, slots.to(DEVICE))
    got = got.cpu()
    assert torch.equal(got, want)
    touched = torch.zeros(48, dtype=torch.bool)
    touched[[3, 17, 47, 8, 0]] = True
    flat_new, flat_old = got.view(2, 48, 2, 40), cache.view(2, 48, 2, 40)
    assert torch.equal(flat_new[:, ~touched], flat_old[:, ~touched])  # -1 rows wrote nothing


def test_store_then_prefill_equals_model_paged_attention():
    """store_kv + prefill_attention == models.attention.paged_attention on one mixed batch."""
    from megainfer.models.attention import AttentionMetadata, paged_attention
    Hq, Hkv, D, BS = 4, 2, 32, 8
    qlens, ctx = [6, 1, 11, 1], [0, 9, 5, 16]
    tables, nxt = [], 1
    for c, n in zip(ctx, qlens):
        nb = -(-(c + n) // BS)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    meta = AttentionMetadata.build(qlens, ctx, tables, BS)
    g = torch.Generator().manual_seed(10)
    cache = torch.randn(2, nxt, BS, Hkv, D, generator=g)
    T = sum(qlens)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    want_cache = cache.clone()
    want = paged_attention(q, k, v, want_cache, meta, 0.2)
    got_cache = cache.to(DEVICE)
    ta().store_kv(k.to(DEVICE), v.to(DEVICE), got_cache, meta.slot_mapping.to(DEVICE))
    assert torch.equal(got_cache.cpu(), want_cache)
    got = run_prefill(q, got_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                      max(qlens), 0.2)
    close(got, want, torch.float32)


def test_check_attention_args_names_the_bad_argument():
    q, cache = torch.zeros(3, 4, 16), torch.zeros(2, 4, 8, 2, 16)
    bt, sl, qsl = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.long), \
        torch.tensor([0, 1, 3])
    check_attention_args(q, cache, bt, sl, qsl)
    bad = [
        (dict(q=torch.zeros(3, 4, 32)), "head_dim"),
        (dict(q=torch.zeros(3, 3, 16)), "multiple"),
        (dict(q=q.half()), "kv_cache: dtype"),
        (dict(q=q.int(), cache=cache.int()), "q: dtype"),
        (dict(cache=torch.zeros(4, 8, 2, 16)), "kv_cache"),
        (dict(bt=bt.float()), "block_tables"),
        (dict(sl=torch.ones(3, dtype=torch.long)), "seq_lens"),
        (dict(qsl=torch.tensor([0, 3])), "query_start_loc"),
        (dict(out=torch.zeros(3, 4, 8)), "out"),
    ]
    for change, needle in bad:
        a = dict(q=q, cache=cache, bt=bt, sl=sl, qsl=qsl, out=None) | change
        with pytest.raises(KernelInputError, match=needle):
            check_attention_args(a["q"], a["cache"], a["bt"], a["sl"], a["qsl"], a["out"])
    with pytest.raises(KernelInputError, match="q: head_dim 320"):
        check_attention_args(torch.zeros(1, 1, 320), torch.zeros(2, 1, 8, 1, 320))
    with pytest.raises(KernelInputError, match="decode"):
        check_attention_args(q, cache, bt, sl, decode=True)
    with pytest.raises(KernelInputError, match="slot_mapping"):
        ta().store_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), cache, torch.zeros(2))
    with pytest.raises(KernelInputError, match="v:"):
        ta().store_kv(torch.zeros(3, 2, 16), torch.zeros(3, 1, 16), cache,
                      torch.zeros(3, dtype=torch.long))
    assert all(supported_head_dim(d) for d in (16, 48, 80, 96, 112, 128, 192, 256))
    assert not supported_head_dim(0) and not supported_head_dim(257)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_large_bf16():
    """32 sequences, contexts up to 2000, D 128, GQA 4, bf16, compiled for real."""
    g = torch.Generator().manual_seed(11)
    ctx = torch.randint(0, 2000, (32,), generator=g).tolist()
    qlens = [1 + (i * 37) % 200 if i % 3 else 1 for i in range(32)]
    args = prefill_case(list(zip(ctx, qlens)), 32, 8, 128, 16, dtype=torch.bfloat16, seed=12)
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    prefill_attention = ta().prefill_attention
    close(prefill_attention(*args, 128 ** -0.5).cpu(),
          prefill_attention_ref(*args, 128 ** -0.5).cpu(), torch.bfloat16)
    _, cache, _, sl, table, _ = args
    q = torch.randn(32, 32, 128, device="cuda", dtype=torch.bfloat16)
    sl = sl.clone()
    sl[5] = 0
    ref = decode_attention_ref(q, cache, sl, table, 128 ** -0.5).cpu()
    for splits in (None, 1, 16):
        close(ta().decode_attention(q, cache, sl, table, 128 ** -0.5, num_splits=splits).cpu(),
              ref, torch.bfloat16)
