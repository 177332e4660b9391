"""What the low-bit KV cache tests share (cache.kv_cache_dtype, docs/kv_cache.md): the formats,
their error bounds, a tiny model and paged attention over a cache in a given format."""
import torch

from megainfer.config import ModelConfig
from megainfer.models.attention import AttentionMetadata, paged_attention
from megainfer.models.kv_spec import KVCacheSpec

QUANT = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
# relative (Frobenius) round-trip error on N(0, 1) and the attention output error bounds
RT_BOUND = {"fp8_e4m3": 0.04, "fp8_e5m2": 0.08, "fp4_e2m1": 0.13}
ATT_BOUND = {"fp8_e4m3": 0.05, "fp8_e5m2": 0.1, "fp4_e2m1": 0.17}
TH = "token_head"


def rel_error(a, b):
    """Relative (Frobenius) error of ``a`` against ``b``."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def tiny_cfg(**kw):
    base = dict(family="qwen3_moe", vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, moe_intermediate_size=32,
                max_position_embeddings=256)
    base.update(kw)
    return ModelConfig(**base)


def _meta(BS=16):
    # two sequences prefilled (one with cached context), then a decode step for both
    return (AttentionMetadata.build([20, 7], [0, 9], [[3, 0], [1]], BS),
            AttentionMetadata.build([1, 1], [20, 16], [[3, 0], [1, 2]], BS))


def run_paged(fmt, D=64, dtype=torch.float32, backend=None, gran="tensor"):
    """Two prefills (one over 9 cached tokens) then a decode step of both, through ``backend``
    (default: torch's paged attention) over a cache in ``fmt`` -> (outputs per step, cache)."""
    torch.manual_seed(3)
    Hq, Hkv, BS = 4, 2, 16
    spec = KVCacheSpec("gqa", (2, Hkv, D), dtype, 1, fmt, kv_granularity=gran)
    cache = spec.allocate(5, BS)[0]
    outs = []
    for step, meta in enumerate(_meta(BS)):
        T = meta.num_tokens
        if step == 0:  # context of sequence 1: 9 tokens already cached in block 1
            ctx = AttentionMetadata.build([9], [0], [[1]], BS)
            kk, vv = torch.randn(9, Hkv, D, dtype=dtype), torch.randn(9, Hkv, D, dtype=dtype)
            (backend or paged_attention)(torch.randn(9, Hq, D, dtype=dtype), kk, vv, cache, ctx,
                                         D ** -0.5)
        q = torch.randn(T, Hq, D, dtype=dtype)
        k, v = torch.randn(T, Hkv, D, dtype=dtype), torch.randn(T, Hkv, D, dtype=dtype)
        outs.append((backend or paged_attention)(q, k, v, cache, meta, D ** -0.5))
    return outs, cache
