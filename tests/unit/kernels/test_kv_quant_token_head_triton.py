"""Triton kernels over a token_head KV cache (each row's scale inline; kernels/kv_quant.py):
the store writes the bytes ``kv_quant.quant_rows`` writes, and prefill / decode read them as
the torch path does (interpreter or GPU)."""
import os

import pytest
import torch

from megainfer.kernels import kv_quant
from megainfer.models.attention_backends import TorchAttention, make_attention_backend
from megainfer.models.kv_spec import KVCacheSpec

from test_kv_quant import _run_paged
from test_kv_quant_triton import fp4_reference, fp4_rows, mla_store_and_decode

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
FORMATS = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1")


@pytest.fixture
def on_device():
    with torch.device(DEVICE):
        yield


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("D", (64, 48))
@pytest.mark.usefixtures("on_device")
def test_triton_token_head_matches_torch(fmt, D):
    ref, ref_cache = _run_paged(fmt, D, backend=TorchAttention(), gran="token_head")
    got, cache = _run_paged(fmt, D, backend=make_attention_backend("triton"), gran="token_head")
    assert cache.shape[-1] == kv_quant.stored_dim(fmt, D, "token_head")
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))  # same bytes
    assert not kv_quant.scales_of(cache).any()  # no per-layer scale set or needed
    for r, g in zip(ref, got):  # prefill (mixed, with context), then a pure decode step
        assert (g - r).abs().max() < 1e-4


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.usefixtures("on_device")
def test_triton_token_head_store_bit_identical_adversarial(fmt):
    """Outliers, zero rows, tiny (subnormal-range) rows, wide ranges within a row: the kernel
    writes kv_quant.quant_rows' bytes; -1 slots write nothing."""
    from megainfer.kernels import triton_attention
    torch.manual_seed(11)
    T, H, D = 6, 3, 32
    k = torch.randn(T, H, D) * torch.logspace(-4, 1, D)
    k[2, 1, 5] = 3e4
    v = torch.randn(T, H, D)
    v[0] = 0.0
    v[1, 0] = 1e-30 * torch.randn(D)
    v[4, 2, :16] = 1e-41  # subnormal float32 values
    if fmt == "fp4_e2m1":  # and the fp4 tests' rows: grid values (ties), outliers, zeros
        fk, fv = fp4_rows(T, H, D)
        k[3:], v[3:] = fk[3:], fv[3:]
        v[5, 2] = 1.75 * 2.0 ** -10  # amax / 1792 a power of two: e exact
    cache = KVCacheSpec("gqa", (2, H, D), torch.float32, 1, fmt,
                        kv_granularity="token_head").allocate(3, 4)[0]
    slots = torch.tensor([3, -1, 0, 11, 5, 6])
    triton_attention.store_kv(k, v, cache, slots, kv_quant.scales_of(cache))
    ref = torch.zeros_like(cache)
    flat, ok = ref.view(2, -1, H, ref.shape[-1]), slots >= 0
    flat[0, slots[ok]] = kv_quant.quant_rows(k[ok], fmt)
    flat[1, slots[ok]] = kv_quant.quant_rows(v[ok], fmt)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    if fmt == "fp4_e2m1":  # least-squared-error block scales: not the amax / 6 rule's bytes
        sc = kv_quant.scales_of(cache)
        assert torch.equal(cache, fp4_reference(k, v, cache, slots, sc, "token_head"))
        assert not torch.equal(cache, fp4_reference(k, v, cache, slots, sc, "token_head",
                                                    "amax/6"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.usefixtures("on_device")
def test_triton_mla_token_head_store_and_decode_match_torch(fmt):
    from megainfer.models.mla_attention import mla_decode_torch, store_latent_torch
    c = mla_store_and_decode(fmt, "token_head", adversarial=True)
    R, P, BS, lat, slots, got = c["R"], c["P"], c["BS"], c["lat"], c["slots"], c["got"]
    q_lat, q_pe, seq_lens, tables = c["q_lat"], c["q_pe"], c["seq_lens"], c["tables"]
    assert c["cache"].shape[-1] == (kv_quant.stored_dim(fmt, R, "token_head")
                                    + kv_quant.stored_dim(fmt, P, "token_head"))
    assert not c["scales"].any()
    full = KVCacheSpec("mla", (R + P,), torch.float32, 1, "auto", (R, P)).allocate(6, BS)[0]
    store_latent_torch(lat[slots >= 0], full, slots[slots >= 0], R)
    exact = mla_decode_torch(q_lat, q_pe, full, seq_lens, tables, 0.1)
    assert (got - exact).norm() / exact.norm() < {"fp8_e4m3": 0.05, "fp8_e5m2": 0.1,
                                                  "fp4_e2m1": 0.2}[fmt]
