"""cache.kv_cache_dtype and cache.kv_scale_granularity from the keys to the engine: the block
count a budget holds per format (``engine/sizing.py``, the planner's bytes per token), the
errors naming the key, and the LLM generating in every format."""
import dataclasses
import math

import pytest
import torch
from kv_quant_util import QUANT, TH, tiny_cfg
from test_resolve import settings

from megainfer.config import CacheConfig, ConfigError, ModelConfig
from megainfer.engine.sizing import check_kv_cache_dtype, derive_num_blocks
from megainfer.kernels import kv_quant
from megainfer.perfmodel.model.shapes import ModelShape


def test_capacity_ratios():
    for cfg in (tiny_cfg(), tiny_cfg(head_dim=128)):
        n = {f: derive_num_blocks(cfg, 256, 10**6, 16, 0.5, torch.bfloat16, kv_cache_dtype=f)
             for f in ("auto",) + QUANT}
        assert n["fp8_e4m3"] >= 1.9 * n["auto"] and n["fp8_e5m2"] >= 1.9 * n["auto"]
        assert n["fp4_e2m1"] >= 3.5 * n["auto"]
    mla = ModelConfig(family="deepseek_v3", vocab_size=64, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=4, num_experts=4, top_k=2,
                      moe_intermediate_size=32, max_position_embeddings=256, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_group=1,
                      topk_group=1, head_dim=32)
    n = {f: derive_num_blocks(mla, 256, 10**6, 16, 0.5, torch.bfloat16, kv_cache_dtype=f)
         for f in ("auto",) + QUANT}
    assert n["fp8_e4m3"] >= 1.9 * n["auto"] and n["fp4_e2m1"] >= 3.5 * n["auto"]


def test_config_errors():
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    odd = tiny_cfg(head_dim=24)
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_dtype=fp4_e2m1.*head_dim=24"):
        check_kv_cache_dtype(odd, "fp4_e2m1")
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype"):
        derive_num_blocks(odd, 256, 4, 16, 0.1, torch.float32, kv_cache_dtype="fp4_e2m1")
    check_kv_cache_dtype(odd, "fp8_e4m3", "triton")
    check_kv_cache_dtype(tiny_cfg(), "fp4_e2m1", "triton")  # the Triton kernels read fp4 too


def _gqa(head_dim, kv_heads=8):
    return ModelConfig(family="mixtral", vocab_size=256, hidden_size=1024, num_layers=2,
                       num_heads=32, num_kv_heads=kv_heads, head_dim=head_dim, num_experts=4,
                       top_k=2, moe_intermediate_size=64, max_position_embeddings=4096)


def _blocks(cfg, fmt, gran):
    return derive_num_blocks(cfg, 2048, 10**9, 16, 1.0, torch.bfloat16, kv_cache_dtype=fmt,
                             kv_scale_granularity=gran)


def test_capacity_at_real_dims():
    """bf16 model, same budget: fp8 token_head >= 1.9x at head_dim >= 64; fp4 token_head >= 3.5x
    at head_dim 128 (Mixtral, Qwen) and for DeepSeek's 512 + 64 latent (73 bytes per 128
    values: 3.507x); at head_dim 64 fp4 token_head is 3.46x (37 bytes per 64 values)."""
    for D in (64, 128):
        auto = _blocks(_gqa(D), "auto", TH)
        for fmt in ("fp8_e4m3", "fp8_e5m2"):
            assert _blocks(_gqa(D), fmt, TH) >= 1.9 * auto
    assert _blocks(_gqa(128), "fp4_e2m1", TH) >= 3.5 * _blocks(_gqa(128), "auto", TH)
    r64 = _blocks(_gqa(64), "fp4_e2m1", TH) / _blocks(_gqa(64), "auto", TH)
    assert 3.45 < r64 < 3.5  # documented: below 3.5x at head_dim 64
    mla = ModelConfig(family="deepseek_v3", vocab_size=256, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=4, head_dim=192, num_experts=8, top_k=2,
                      moe_intermediate_size=32, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096)
    auto = _blocks(mla, "auto", TH)
    assert _blocks(mla, "fp8_e4m3", TH) >= 1.9 * auto
    assert _blocks(mla, "fp4_e2m1", TH) >= 3.5 * auto


def test_planner_counts_the_inline_scales():
    shape = ModelShape(name="m", hidden_size=1024, num_layers=2, num_heads=32, num_kv_heads=8,
                       head_dim=128, num_experts=4, top_k=2, moe_intermediate_size=64,
                       vocab_size=256)
    b = {g: dataclasses.replace(shape, kv_cache_dtype="fp4_e2m1",
                                kv_scale_granularity=g).kv_bytes_per_token() for g in
         ("tensor", TH)}
    assert b["tensor"] == 2 * 16 * 72 and b[TH] == 2 * 16 * 73
    with pytest.raises(ConfigError, match="cache.kv_scale_granularity"):
        dataclasses.replace(shape, kv_scale_granularity="block")


def test_config_key_default_and_errors():
    assert CacheConfig().kv_scale_granularity == TH
    with pytest.raises(ConfigError, match="cache.kv_scale_granularity"):
        CacheConfig(kv_scale_granularity="channel")
    from megainfer import LLM
    llm = LLM(tiny_cfg(), max_model_len=64, max_num_seqs=2, kv_cache_dtype="fp8_e4m3")
    assert kv_quant.granularity_of(llm.engine.kv_caches[0]) == TH
    assert llm.engine.kv_caches[0].shape[-1] == kv_quant.stored_dim("fp8_e4m3", 16, TH)
    llm = LLM(tiny_cfg(), max_model_len=64, max_num_seqs=2, kv_cache_dtype="fp8_e4m3",
              kv_scale_granularity="tensor")
    assert kv_quant.granularity_of(llm.engine.kv_caches[0]) == "tensor"
    assert llm.engine.kv_caches[0].shape[-1] == kv_quant.stored_dim("fp8_e4m3", 16, "tensor")


def test_hydra_cache_kv_cache_dtype_sizes_the_cache():
    base = ["cache.memory_gib=0.001", "scheduler.max_num_seqs=4096"]
    n = {f: settings(*base, f"cache.kv_cache_dtype={f}").cache for f in ("auto", "fp8_e4m3")}
    assert n["fp8_e4m3"].kv_cache_dtype == "fp8_e4m3"
    assert n["fp8_e4m3"].num_blocks >= 1.9 * n["auto"].num_blocks
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype"):
        settings(*base, "cache.kv_cache_dtype=int3")


def test_hydra_key():
    base = ["cache.memory_gib=0.001", "scheduler.max_num_seqs=4096", "cache.kv_cache_dtype=fp8_e4m3"]
    th, t = settings(*base).cache, settings(*base, "cache.kv_scale_granularity=tensor").cache
    assert th.kv_scale_granularity == TH and t.kv_scale_granularity == "tensor"
    assert th.num_blocks < t.num_blocks  # the inline scales take their room
    with pytest.raises(ConfigError, match="cache.kv_scale_granularity"):
        settings(*base, "cache.kv_scale_granularity=block")


def _top1(pl):
    return [next(t for t, lp in d.items() if lp.rank == 1) for d in pl[1:]]


@pytest.mark.parametrize("gran", ("tensor", "token_head"))
def test_llm_greedy_runs_per_format(tiny_ckpts, gran):
    from megainfer import LLM, SamplingParams
    path = tiny_ckpts[("qwen3_moe", "base")]
    # ignore_eos: 8 steps in every format (an EOS picked on these random weights is no error)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # teacher forcing: the top-1 next token at every prompt position (prompt_logprobs)
    forced = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    text = "The paged KV cache stores keys and values of every token in blocks. " * 3
    prompts = ["hello world", "the quick brown fox jumps"]
    top1 = {}
    for fmt in ("auto",) + QUANT:
        llm = LLM(path, max_model_len=256, max_num_seqs=2, kv_cache_dtype=fmt,
                  kv_scale_granularity=gran)
        assert llm.engine.kv_caches[0].dtype == kv_quant.storage_dtype(fmt, torch.float32)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        top1[fmt] = _top1(llm.generate([text], forced, use_tqdm=False)[0].prompt_logprobs)
    n = len(top1["auto"])
    agree = {f: sum(a == b for a, b in zip(top1[f], top1["auto"])) / n for f in QUANT}
    assert n > 150 and agree["fp8_e4m3"] >= 0.8 and agree["fp8_e5m2"] >= 0.6, agree


def test_llm_capacity_follows_kv_cache_dtype():
    from megainfer import LLM
    cfg = tiny_cfg()
    n = {f: LLM(cfg, max_model_len=256, max_num_seqs=4096, kv_cache_memory_gib=0.01,
                kv_cache_dtype=f).engine.cache_config.num_blocks for f in ("auto", "fp8_e5m2",
                                                                             "fp4_e2m1")}
    assert n["fp8_e5m2"] >= 1.9 * n["auto"] and n["fp4_e2m1"] >= 3.5 * n["auto"]
    assert not math.isnan(n["auto"])
