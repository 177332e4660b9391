"""Absorbed MLA Triton kernels (interpreter, TRITON_INTERPRET=1, or a GPU) against the torch
references in kernels/mla_ref.py, and the absorbed form against expanded attention."""
import os

import pytest
import torch

from megainfer.kernels.dispatch import KernelInputError
from megainfer.kernels.mla_ref import (check_mla_args, mla_decode_ref, mla_prefill_ref,
                                       store_latent_ref, supported_mla_dims)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton needs a GPU or TRITON_INTERPRET=1")
# compiled for real on a GPU (TRITON_INTERPRET unset or 0): inputs are built on the CPU, moved
# there for the Triton call, and outputs come back to be compared with the references
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
LENS = [0, 1, 16, 33, 70]  # a padded row, one row, block boundaries of 4/8/16, ragged


def tm():
    from megainfer.kernels import triton_mla
    return triton_mla


def make_cache(seq_lens, W, BS, dtype, seed, width=None, index=torch.int32):
    """Latent cache with random rows on each sequence's live slots and NaN everywhere else
    (unused slots of a last block, spare blocks, and block 0 that padding table entries point
    at): reading anything past seq_len poisons the output. -> cache, block_tables [S, width]."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in seq_lens]
    NB = sum(need) + 2
    width = max(max(need, default=1), 1) if width is None else width
    cache = torch.full((NB, BS, W), float("nan"), dtype=dtype)
    ids = torch.randperm(NB - 1, generator=g) + 1
    table = torch.zeros(len(seq_lens), width, dtype=index)
    k = 0
    for s, n in enumerate(seq_lens):
        table[s, :need[s]] = ids[k:k + need[s]]
        k += need[s]
        pos = torch.arange(n)
        cache[table[s].long()[pos // BS], pos % BS] = torch.randn(n, W, generator=g).to(dtype)
    return cache, table


def make_q(S, H, R, P, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, H, R, generator=g).to(dtype), torch.randn(S, H, P, generator=g).to(dtype)


def run_decode(ql, qp, cache, sl, table, scale, R, **kw):
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return tm().mla_decode(to(ql), to(qp), to(cache), to(sl), to(table), scale, R, **kw).cpu()


def close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


# (R, P, H, block_size, splits): H 1/3/5/12/16, odd R and P masked, splits 1 and > 1
CASES = [(64, 16, 16, 16, 1), (64, 16, 12, 8, 3), (48, 16, 3, 4, 2), (32, 16, 1, 8, 4),
         (40, 12, 5, 16, 3)]


@pytest.mark.parametrize("R,P,H,BS,splits", CASES, ids=lambda c: str(c))
def test_decode_matches_ref(R, P, H, BS, splits):
    cache, table = make_cache(LENS, R + P, BS, torch.float32, seed=R + H,
                              index=torch.int64 if splits == 1 else torch.int32)
    ql, qp = make_q(len(LENS), H, R, P, torch.float32, seed=H)
    sl, scale = torch.tensor(LENS), (R + P) ** -0.5
    out = run_decode(ql, qp, cache, sl, table, scale, R, num_splits=splits)
    close(out, mla_decode_ref(ql, qp, cache, sl, table, scale, R), torch.float32)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # seq_len 0: zeros, not NaN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("splits", [None, 4])
def test_decode_half_dtypes_and_default_splits(dtype, splits):
    lens = [0, 32, 45]
    cache, table = make_cache(lens, 64 + 16, 16, dtype, seed=7, width=4)
    ql, qp = make_q(3, 12, 64, 16, dtype, seed=8)
    sl = torch.tensor(lens)
    out = run_decode(ql, qp, cache, sl, table, 0.1, 64, num_splits=splits)
    assert out.dtype == dtype
    close(out, mla_decode_ref(ql, qp, cache, sl, table, 0.1, 64), dtype)


def test_decode_more_splits_than_rows_strided_q_and_out():
    """8 splits over 1-9 rows (empty splits merge away); q_latent and q_pe are views of one
    [S, H, R + P] tensor; the result goes into out=."""
    R, P, H, lens = 32, 16, 4, [1, 9, 0]
    cache, table = make_cache(lens, R + P, 8, torch.float32, seed=9, width=3)
    q = torch.randn(3, H, R + P)
    sl = torch.tensor(lens)
    ref = mla_decode_ref(q[..., :R], q[..., R:], cache, sl, table, 0.2, R)
    qd = q.to(DEVICE)
    for splits in (1, 8):
        out = torch.full((3, H, R), 7.0, device=DEVICE)
        got = tm().mla_decode(qd[..., :R], qd[..., R:], cache.to(DEVICE), sl.to(DEVICE),
                              table.to(DEVICE), 0.2, R, num_splits=splits, out=out)
        assert got is out
        close(out.cpu(), ref, torch.float32)


def test_absorbed_equals_expanded_attention():
    """mla_decode on q_latent = q_nope @ W_UK, then @ W_UV == attention with per-head keys
    [c_kv @ W_UK^T, k_pe] and values c_kv @ W_UV (computed in float64), fp32 within 1e-5."""
    R, P, H, Dn, Dv, BS = 64, 16, 3, 32, 24, 8
    lens = [5, 37, 0, 64]
    g = torch.Generator().manual_seed(12)
    cache, table = make_cache(lens, R + P, BS, torch.float32, seed=13)
    w_uk = torch.randn(H, Dn, R, generator=g) * R ** -0.5
    w_uv = torch.randn(H, R, Dv, generator=g) * R ** -0.5
    q_nope = torch.randn(len(lens), H, Dn, generator=g)
    q_pe = torch.randn(len(lens), H, P, generator=g)
    scale = (Dn + P) ** -0.5
    want = torch.zeros(len(lens), H, Dv, dtype=torch.float64)
    for s, L in enumerate(lens):
        if L == 0:
            continue
        pos = torch.arange(L)
        rows = cache[table[s].long()[pos // BS], pos % BS].double()  # [L, R + P]
        c_kv, k_pe = rows[:, :R], rows[:, R:]
        for h in range(H):
            k = torch.cat([c_kv @ w_uk[h].double().T, k_pe], 1)  # [L, Dn + P]
            v = c_kv @ w_uv[h].double()  # [L, Dv]
            q = torch.cat([q_nope[s, h], q_pe[s, h]]).double()
            want[s, h] = torch.softmax(k @ q * scale, 0) @ v
    q_latent = torch.einsum("shd,hdr->shr", q_nope, w_uk)
    for splits in (1, 3):
        lat = run_decode(q_latent, q_pe, cache, torch.tensor(lens), table, scale, R,
                         num_splits=splits)
        got = torch.einsum("shr,hrv->shv", lat, w_uv)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_num_splits_uses_host_info_only():
    f = tm().choose_mla_num_splits
    assert f(1, 16, 1, 16, torch.device("cpu")) == 1  # 16 rows: nothing to split
    assert f(1, 16, 128, 16, torch.device("cpu")) > 1  # one long sequence: split it
    assert f(64, 128, 128, 16, torch.device("cpu")) == 1  # many programs already
    assert 1 <= f(4, 3, 1000, 32, torch.device("cpu")) <= 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("index", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_store_latent_matches_ref_and_skips_padding(dtype, index):
    g = torch.Generator().manual_seed(14)
    W = 40 + 12  # odd R + P: masked to a power of two
    cache = torch.randn(6, 8, W, generator=g).to(dtype)
    latent = torch.randn(7, W + 5, generator=g).to(dtype)[:, :W]  # strided rows
    slots = torch.tensor([3, -1, 17, 47, -1, 8, 0], dtype=index)
    want = cache.clone()
    store_latent_ref(latent, want, slots)
    got = cache.to(DEVICE)
    tm().store_latent(latent.to(DEVICE), got, slots.to(DEVICE))
    got = got.cpu()
    assert torch.equal(got, want)
    touched = torch.zeros(48, dtype=torch.bool)
    touched[[3, 17, 47, 8, 0]] = True
    assert torch.equal(got.view(48, W)[~touched], cache.view(48, W)[~touched])  # -1: no write
    assert torch.equal(got.view(48, W)[[3, 17, 47, 8, 0]], latent[[0, 2, 3, 5, 6]])


def test_store_then_decode_equals_prefill_ref_last_rows():
    """store_latent a batch of new rows, then mla_decode for each sequence's last token ==
    mla_prefill_ref's last query row (the prefill reference agrees with decode)."""
    R, P, H, BS = 32, 16, 5, 4
    ctx, qlens = [0, 6, 11], [3, 1, 5]
    tables, nxt, slots = [], 1, []
    for c, n in zip(ctx, qlens):
        nb = -(-(c + n) // BS)
        tables.append(list(range(nxt, nxt + nb)) + [0] * (4 - nb))
        slots += [tables[-1][p // BS] * BS + p % BS for p in range(c, c + n)]
        nxt += nb
    g = torch.Generator().manual_seed(15)
    cache = torch.randn(nxt, BS, R + P, generator=g)
    table, sl = torch.tensor(tables), torch.tensor([c + n for c, n in zip(ctx, qlens)])
    T = sum(qlens)
    latent = torch.randn(T, R + P, generator=g)
    ql, qp = torch.randn(T, H, R, generator=g), torch.randn(T, H, P, generator=g)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist())
    got_cache = cache.to(DEVICE)
    tm().store_latent(latent.to(DEVICE), got_cache, torch.tensor(slots).to(DEVICE))
    got_cache = got_cache.cpu()
    want = mla_prefill_ref(ql, qp, got_cache, qsl, sl, table, 0.15, R)
    last = qsl[1:] - 1
    out = run_decode(ql[last], qp[last], got_cache, sl, table, 0.15, R, num_splits=2)
    close(out, want[last], torch.float32)
    close(mla_decode_ref(ql[last], qp[last], got_cache, sl, table, 0.15, R), want[last],
          torch.float32)


def test_check_mla_args_names_the_bad_argument():
    ql, qp, cache = torch.zeros(2, 3, 32), torch.zeros(2, 3, 16), torch.zeros(4, 8, 48)
    bt, sl = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.long)
    check_mla_args(ql, qp, cache, 32, bt, sl)
    bad = [
        (dict(R=16), "q_latent: last dim"),
        (dict(ql=torch.zeros(2, 32)), "q_latent"),
        (dict(qp=torch.zeros(2, 3, 8)), "q_pe"),
        (dict(cache=torch.zeros(4, 8, 32 + 80)), "kv_lora_rank"),
        (dict(cache=torch.zeros(8, 48)), "cache"),
        (dict(ql=ql.half(), qp=qp.half()), "cache: dtype"),
        (dict(qp=qp.half()), "q_pe: dtype"),
        (dict(ql=ql.int(), qp=qp.int(), cache=cache.int()), "dtype"),
        (dict(bt=bt.float()), "block_tables"),
        (dict(bt=torch.zeros(3, 3, dtype=torch.int32)), "block_tables"),
        (dict(sl=torch.ones(3, dtype=torch.long)), "seq_lens"),
        (dict(out=torch.zeros(2, 3, 16)), "out"),
        (dict(ql=torch.zeros(2, 3, 64)[..., ::2]), "contiguous"),
    ]
    for change, needle in bad:
        a = dict(ql=ql, qp=qp, cache=cache, R=32, bt=bt, sl=sl, out=None) | change
        with pytest.raises(KernelInputError, match=needle):
            check_mla_args(a["ql"], a["qp"], a["cache"], a["R"], a["bt"], a["sl"], a["out"])
    with pytest.raises(KernelInputError, match="kv_lora_rank"):  # R > 512
        check_mla_args(torch.zeros(1, 1, 520), torch.zeros(1, 1, 8), torch.zeros(1, 4, 528), 520)
    with pytest.raises(KernelInputError, match="slot_mapping"):
        tm().store_latent(torch.zeros(3, 48), cache, torch.zeros(2, dtype=torch.long))
    with pytest.raises(KernelInputError, match="latent"):
        tm().store_latent(torch.zeros(3, 40), cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(KernelInputError, match="num_splits"):
        tm().mla_decode(ql, qp, cache, sl, bt, 0.1, 32, num_splits=0)
    assert supported_mla_dims(512, 64) and supported_mla_dims(40, 12)
    assert not supported_mla_dims(513, 64) and not supported_mla_dims(512, 65)
    assert not supported_mla_dims(512, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_deepseek_sizes_bf16():
    """R 512, P 64, H 16, bf16, 32 sequences with contexts up to 2000, compiled for real."""
    R, P, H, BS = 512, 64, 16, 64
    g = torch.Generator().manual_seed(16)
    lens = torch.randint(1, 2000, (32,), generator=g).tolist()
    lens[5] = 0
    cache, table = make_cache(lens, R + P, BS, torch.bfloat16, seed=17)
    ql, qp = make_q(32, H, R, P, torch.bfloat16, seed=18)
    args = [x.cuda() for x in (ql, qp, cache, torch.tensor(lens), table)]
    scale = (128 + 64) ** -0.5  # DeepSeek-V3: qk_nope 128 + rope 64
    ref = mla_decode_ref(*args, scale, R).cpu()
    for splits in (None, 1, 16):
        close(tm().mla_decode(*args, scale, R, num_splits=splits).cpu(), ref, torch.bfloat16)
    latent = torch.randn(40, R + P, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(cache.shape[0] * BS, device="cuda")[:40]
    slots[::7] = -1
    want = args[2].clone()
    store_latent_ref(latent, want, slots)
    tm().store_latent(latent, args[2], slots)
    torch.testing.assert_close(args[2].cpu(), want.cpu(), rtol=0, atol=0, equal_nan=True)
