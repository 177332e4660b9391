"""The model's KV cache spec in a low-bit format (``models/kv_spec.py``): shapes, bytes and the
block axis, and what is stored through it: paged attention and the MLA latent against full
precision, a token's row independent of its batch, TP without scale agreement."""
import pytest
import torch
from kv_quant_util import ATT_BOUND, QUANT, RT_BOUND, TH, rel_error, run_paged

from megainfer.config import ModelConfig
from megainfer.kernels import kv_quant
from megainfer.models.attention import store_kv_torch
from megainfer.models.kv_spec import KVCacheSpec, kv_cache_spec_for
from megainfer.models.layers import ParallelContext, agree_kv_scales
from megainfer.models.mla_attention import dequant_latent, store_latent_torch


def test_spec_shapes_and_bytes():
    g = KVCacheSpec("gqa", (2, 2, 64), torch.bfloat16, 3)
    assert g.bytes_per_token() == 3 * 2 * 2 * 64 * 2
    f8 = KVCacheSpec("gqa", (2, 2, 64), torch.bfloat16, 3, "fp8_e4m3")
    assert f8.bytes_per_token() == 3 * 2 * 2 * 64 and f8.layer_shape(5, 16) == (2, 5, 16, 2, 64)
    f4 = KVCacheSpec("gqa", (2, 2, 64), torch.bfloat16, 3, "fp4_e2m1")
    assert f4.layer_shape(5, 16) == (2, 5, 16, 2, 36)  # 32 packed + 4 scale bytes
    assert f4.bytes_per_token() == 3 * 2 * 2 * 36
    c = f4.allocate(5, 16)
    assert len(c) == 3 and c[0].dtype == torch.uint8 and kv_quant.scales_of(c[0]).sum() == 0
    m = KVCacheSpec("mla", (48,), torch.bfloat16, 2, "fp4_e2m1", (32, 16))
    assert m.layer_shape(4, 16) == (4, 16, kv_quant.stored_dim("fp4_e2m1", 32)
                                    + kv_quant.stored_dim("fp4_e2m1", 16))
    with pytest.raises(ValueError):
        KVCacheSpec("gqa", (2, 2, 64), kv_format="int4")


def test_spec_block_axis_indexes_blocks():
    """The spec owns the block axis: the num_blocks dimension of its layer shape, every format."""
    specs = (KVCacheSpec("gqa", (2, 2, 64)), KVCacheSpec("gqa", (2, 2, 64), kv_format="fp4_e2m1"),
             KVCacheSpec("mla", (48,), parts=(32, 16)),
             KVCacheSpec("mla", (48,), kv_format="fp8_e4m3", parts=(32, 16)))
    for spec in specs:
        shape, d = spec.layer_shape(5, 16), spec.block_axis
        assert shape[d] == 5 and shape[d + 1] == 16
        one_block = spec.allocate(5, 16)[0].select(d, 0)
        assert tuple(one_block.shape) == shape[:d] + shape[d + 1:]


@pytest.mark.parametrize("gran", ["tensor", "token_head"])
@pytest.mark.parametrize("fmt", QUANT)
def test_torch_paged_attention_vs_full_precision(fmt, gran):
    ref, _ = run_paged("auto")
    got, cache = run_paged(fmt, gran=gran)
    assert cache.dtype == kv_quant.storage_dtype(fmt, torch.float32)
    assert cache.shape[-1] == kv_quant.stored_dim(fmt, 64, gran)
    # per-layer scales: set by the first write (tensor); never used (token_head: each row's own)
    assert (kv_quant.scales_of(cache) > 0).all() if gran == "tensor" else \
        not kv_quant.scales_of(cache).any()
    for r, g in zip(ref, got):
        assert rel_error(g, r) < ATT_BOUND[fmt]


@pytest.mark.parametrize("fmt", QUANT)
def test_mla_latent_cache_round_trip(fmt):
    torch.manual_seed(4)
    R, P = 32, 16
    spec = kv_cache_spec_for(ModelConfig(
        family="deepseek_v3", vocab_size=64, hidden_size=64, num_layers=1, num_heads=4,
        num_kv_heads=4, num_experts=4, top_k=2, moe_intermediate_size=32,
        max_position_embeddings=64, kv_lora_rank=R, qk_nope_head_dim=16, qk_rope_head_dim=P,
        v_head_dim=16, n_group=1, topk_group=1, head_dim=32), kv_format=fmt)
    cache = spec.allocate(3, 16)[0]
    lat = torch.randn(20, R + P)
    lat[:, R:] *= 10  # k_pe on another scale than c_kv: quantised apart
    store_latent_torch(lat, cache, torch.arange(20), R)
    back = dequant_latent(cache.view(-1, cache.shape[-1])[:20], cache, R, torch.float32)
    assert rel_error(back[:, :R], lat[:, :R]) < RT_BOUND[fmt]
    assert rel_error(back[:, R:], lat[:, R:]) < RT_BOUND[fmt]


@pytest.mark.parametrize("fmt", QUANT)
def test_row_bytes_independent_of_the_batch(fmt):
    """A token's stored row is the same whatever else is written with it (micro-batch splits,
    batches, TP head splits): token_head; per-layer scales from the first write are not."""
    torch.manual_seed(2)
    H, D = 2, 64
    k, v = torch.randn(6, H, D), torch.randn(6, H, D)
    loud_k, loud_v = 50 * torch.randn(5, H, D), 50 * torch.randn(5, H, D)

    def store(gran, batches):
        cache = KVCacheSpec("gqa", (2, H, D), torch.float32, 1, fmt,
                            kv_granularity=gran).allocate(2, 8)[0]
        for kk, vv, slots in batches:
            store_kv_torch(kk, vv, cache, slots)
        return cache.view(torch.uint8)
    whole = [(k, v, torch.arange(6))]
    split = [(k[3:], v[3:], torch.arange(3, 6)), (k[:3], v[:3], torch.arange(3))]
    mixed = [(torch.cat([loud_k, k]), torch.cat([loud_v, v]),
              torch.cat([torch.arange(10, 15), torch.arange(6)]))]
    ref = store(TH, whole)
    assert torch.equal(ref, store(TH, split))
    assert torch.equal(ref[:, 0, :6], store(TH, mixed)[:, 0, :6])
    # the first-write per-layer scales change with the split: tensor mode differs
    t = store("tensor", whole)
    assert not torch.equal(t, store("tensor", split)) or not torch.equal(
        t[:, 0, :6], store("tensor", mixed)[:, 0, :6])
    # a TP rank holding head 1 only stores head 1's bytes as the full cache does
    half = KVCacheSpec("gqa", (2, 1, D), torch.float32, 1, fmt, kv_granularity=TH).allocate(2, 8)[0]
    store_kv_torch(k[:, 1:], v[:, 1:], half, torch.arange(6))
    assert torch.equal(half.view(torch.uint8)[:, :, :, 0], ref[:, :, :, 1])


@pytest.mark.parametrize("fmt", QUANT)
def test_mla_latent_token_head_round_trip(fmt):
    torch.manual_seed(4)
    R, P = 32, 16
    cache = KVCacheSpec("mla", (R + P,), torch.float32, 1, fmt, (R, P), TH).allocate(3, 16)[0]
    lat = torch.randn(20, R + P)
    lat[:, R:] *= 100  # k_pe on another range: its own scale per token
    store_latent_torch(lat, cache, torch.arange(20), R)
    got = dequant_latent(cache.view(-1, cache.shape[-1])[:20], cache, R, torch.float32)
    assert rel_error(got[:, :R], lat[:, :R]) < RT_BOUND[fmt]
    assert rel_error(got[:, R:], lat[:, R:]) < RT_BOUND[fmt]
    assert not kv_quant.scales_of(cache).any()


def test_tp_needs_no_scale_agreement():
    calls = []

    def all_reduce(x):
        calls.append(x)
        return x
    par = ParallelContext(0, 2, all_reduce)
    cache = KVCacheSpec("gqa", (2, 1, 16), torch.float32, 1, "fp8_e4m3",
                        kv_granularity=TH).allocate(2, 4)[0]
    agree_kv_scales(cache, torch.randn(3, 1, 16), torch.randn(3, 1, 16), par)
    assert calls == []  # no collective
    tens = KVCacheSpec("gqa", (2, 1, 16), torch.float32, 1, "fp8_e4m3").allocate(2, 4)[0]
    agree_kv_scales(tens, torch.randn(3, 1, 16), torch.randn(3, 1, 16), par)
    assert len(calls) == 1
