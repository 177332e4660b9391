"""The performance model counts KV bytes in ``cache.kv_cache_dtype`` exactly as the engine's cache
stores them (block scales included), and the planner's batch follows: a smaller cache holds more
sequences per attention device; bad formats fail naming the key. Also the bench's accuracy
helpers (megainfer/bench/kv_accuracy.py)."""
import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from megainfer.config import KV_CACHE_DTYPES, ConfigError, ModelConfig
from megainfer.models.kv_spec import kv_cache_spec_for
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.layer_times import RooflineTimes
from megainfer.perfmodel.model.shapes import KV_CACHE_BYTES, ModelShape
from megainfer.perfmodel.plan.planner import SearchSpace, plan_disaggregated
from perfmodel_helpers import TINY, synthetic_hw
from repo_paths import REPO

ROOT = REPO
DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _gqa_config(head_dim=64, kv_heads=4, layers=3):
    return ModelConfig(family="mixtral", vocab_size=256, hidden_size=8 * head_dim,
                       num_layers=layers, num_heads=8, num_kv_heads=kv_heads, head_dim=head_dim,
                       num_experts=4, top_k=2, moe_intermediate_size=64)


def test_formats_match_the_engine_config():
    assert tuple(KV_CACHE_BYTES) == tuple(KV_CACHE_DTYPES)


@pytest.mark.parametrize("fmt", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("gran", ["tensor", "token_head"])
def test_bytes_per_token_equal_the_engine_cache(fmt, dtype, tp, gran):
    cfg = _gqa_config()
    shape = dataclasses.replace(ModelShape.from_model_config(cfg), kv_cache_dtype=fmt,
                                kv_scale_granularity=gran)
    spec = kv_cache_spec_for(cfg, tp_size=tp, dtype=DTYPE[dtype], kv_format=fmt,
                             kv_granularity=gran)
    assert shape.kv_bytes_per_token(dtype, tp) == spec.bytes_per_token()


def test_mla_latent_bytes_equal_the_engine_cache():
    # DeepSeek-V3-like latent 512 + 64 (conf/plan_model/deepseek_v3.yaml: kv_elems_override 576)
    cfg = ModelConfig(family="deepseek_v3", vocab_size=256, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=4, head_dim=192, num_experts=8, top_k=2,
                      moe_intermediate_size=32, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128)
    for fmt, gran in itertools.product(KV_CACHE_DTYPES, ("tensor", "token_head")):
        shape = ModelShape(name="mla", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                           head_dim=192, num_experts=8, top_k=2, moe_intermediate_size=32,
                           vocab_size=256, kv_elems_override=576, kv_cache_dtype=fmt,
                           kv_scale_granularity=gran)
        spec = kv_cache_spec_for(cfg, tp_size=4, dtype=torch.bfloat16, kv_format=fmt,
                                 kv_granularity=gran)
        assert shape.kv_bytes_per_token("bfloat16", tp=4) == spec.bytes_per_token()


def test_bad_formats_name_the_key():
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype='int4'"):
        dataclasses.replace(TINY, kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype=fp4_e2m1.*model.head_dim=24"):
        dataclasses.replace(TINY, head_dim=24, kv_cache_dtype="fp4_e2m1")
    with pytest.raises(ConfigError, match="model.kv_elems_override=40"):
        dataclasses.replace(TINY, kv_elems_override=40, kv_cache_dtype="fp4_e2m1")


def test_memory_and_kv_read_follow_the_format():
    hw, wl = synthetic_hw(mem=2.5e6), Workload(64, 32)
    plan = Plan(1, 1, 1, 1, 1, 8, hw.name, hw.name)
    mem, t = {}, {}
    for fmt in KV_CACHE_DTYPES:
        shape = dataclasses.replace(TINY, kv_cache_dtype=fmt, kv_scale_granularity="tensor")
        times = RooflineTimes(hw, shape)
        model = DisaggModel(shape, times, times, wl)
        empty = dataclasses.replace(plan, batch=0)
        mem[fmt] = model.mem_attention(plan) - model.mem_attention(empty)
        t[fmt] = times.t_attn(4096, 4096)  # KV-read bound
    assert mem["fp8_e4m3"] == mem["fp8_e5m2"] == mem["auto"] / 2
    assert mem["fp4_e2m1"] == mem["auto"] * 9 / 32
    assert t["fp4_e2m1"] < t["fp8_e4m3"] < t["auto"]


def test_planner_batch_grows_when_kv_memory_binds():
    hw, wl = synthetic_hw(mem=2.5e6), Workload(64, 32)
    space = SearchSpace(tpot_slo_s=1.0, tp_choices=(1,), replica_choices=(1,), micro_batches=(1,),
                        expert_ranks=(8,), max_batch=1 << 14)
    best = {}
    for fmt in ("auto", "fp8_e4m3", "fp4_e2m1"):
        r = plan_disaggregated(dataclasses.replace(TINY, kv_cache_dtype=fmt,
                                                   kv_scale_granularity="tensor"),
                               [hw], wl, space)[0]
        assert r.binding == "kv_memory"
        best[fmt] = r.pred.plan.batch
    assert 1.9 * best["auto"] <= best["fp8_e4m3"] and 3.4 * best["auto"] <= best["fp4_e2m1"]


def test_megainfer_plan_takes_cache_kv_cache_dtype(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "megainfer-plan")
    batch = {}
    for fmt in ("auto", "fp4_e2m1"):
        r = subprocess.run(
            [exe, "model=mixtral_8x22b", "hardware=h100", f"cache.kv_cache_dtype={fmt}",
             "workload.input_len=8192", "search.replica_choices=[4]", "search.tp_choices=[4]",
             "search.micro_batches=[2]", "colocated=false", "out.timeline=false", "top=1",
             f"out.dir={tmp_path / fmt}"], capture_output=True, text=True, cwd=ROOT, timeout=240)
        assert r.returncode == 0, r.stderr
        plans = json.load(open(tmp_path / fmt / "plans.json"))["plans"]
        assert plans[0]["binding"] == "kv_memory"
        batch[fmt] = plans[0]["plan"]["batch"]
    assert batch["fp4_e2m1"] >= 3 * batch["auto"]
    r = subprocess.run([exe, "cache.kv_cache_dtype=fp6", f"out.dir={tmp_path}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert r.returncode == 2 and "cache.kv_cache_dtype='fp6'" in r.stderr


def test_bench_helpers_emulation_is_faithful_and_metrics_sane(tmp_path):
    """megainfer/bench/kv_accuracy.py: the emulated per-layer fp8 store gives exactly the stored
    fp8_e4m3 format's logits (so its per-token sibling is a fair ablation); compare() on
    identical logits is perfect and on a flipped top-1 is not."""
    from megainfer.config import LoadConfig
    from megainfer.models.loader import build_model
    from megainfer.tools.make_tiny import make_tiny
    from megainfer.bench import kv_accuracy as acc
    path = make_tiny("mixtral", str(tmp_path / "m"))
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, LoadConfig(path=path, dtype="float32")).eval()
    seqs = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    real = acc.forced_logits(model, cfg, seqs, "fp8_e4m3", 16)
    with acc.emulate("per-layer"):
        emu = acc.forced_logits(model, cfg, seqs, "auto", 16)
    assert torch.equal(real, emu)
    same = acc.compare(real, real)
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] == 0.0 and same["logit_err_rms"] == 0
    flipped = real.clone()
    flipped[0, real[0].argmax()] = real[0].min() - 1
    assert acc.compare(real, flipped)["top1_agreement"] < 1.0


def test_megainfer_plan_takes_cache_kv_scale_granularity(tmp_path):
    """``cache.kv_scale_granularity`` reaches the planner's KV bytes: per-tensor scales hold more
    tokens than the default per-row ones (no inline scale bytes); a bad value exits 2 naming it."""
    exe = os.path.join(os.path.dirname(sys.executable), "megainfer-plan")
    batch = {}
    for gran in ("token_head", "tensor"):
        r = subprocess.run(
            [exe, "model=mixtral_8x22b", "hardware=h100", "cache.kv_cache_dtype=fp4_e2m1",
             f"cache.kv_scale_granularity={gran}", "workload.input_len=8192",
             "search.replica_choices=[4]", "search.tp_choices=[4]", "search.micro_batches=[2]",
             "colocated=false", "out.timeline=false", "top=1", f"out.dir={tmp_path / gran}"],
            capture_output=True, text=True, cwd=ROOT, timeout=240)
        assert r.returncode == 0, r.stderr
        plans = json.load(open(tmp_path / gran / "plans.json"))["plans"]
        assert plans[0]["binding"] == "kv_memory"
        batch[gran] = plans[0]["plan"]["batch"]
    assert batch["tensor"] > batch["token_head"]  # 64,512 vs 65,408 KV bytes per token
    r = subprocess.run([exe, "cache.kv_cache_dtype=fp8_e4m3", "cache.kv_scale_granularity=row",
                        f"out.dir={tmp_path}"], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert r.returncode == 2 and "cache.kv_scale_granularity='row'" in r.stderr
