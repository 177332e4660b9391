"""The planner counts weights in their stored format (``model.quantization``,
perfmodel/model/weight_format.py): the bytes equal what the loader allocates, decode reads
fewer bytes, DeepSeek-V3 fits 8 x H200 in fp8 and not in bf16 (the refusal gives the numbers),
and ``deploy=auto`` and ``megainfer-plan`` take the format."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from megainfer.config import ConfigError, LoadConfig, ModelConfig
from megainfer.models.loader import weight_bytes
from megainfer.perfmodel.model.disagg import Workload
from megainfer.perfmodel.model.hardware import hardware_dir, load_hardware
from megainfer.perfmodel.model.layer_times import RooflineTimes
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.model.weight_format import checkpoint_quantization
from megainfer.perfmodel.plan.api import PlanOptions, run_plan
from megainfer.perfmodel.plan.auto_plan import job_shape, model_shape
from megainfer.perfmodel.plan.planner import ModelTooLargeError, SearchSpace
from megainfer.perfmodel.plan.world_plan import JobLoad, NoWorldPlanError, plan_world
from perfmodel_helpers import synthetic_hw
from repo_paths import REPO

GiB = 1 << 30
FORMATS = (None, "fp8", "int8", "int4")
CONFIGS = {
    "mixtral": dict(family="mixtral", vocab_size=256, hidden_size=256, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=64, num_experts=8, top_k=2,
                    moe_intermediate_size=512),
    "deepseek_v3": dict(family="deepseek_v3", vocab_size=256, hidden_size=256, num_layers=2,
                        num_heads=4, num_kv_heads=4, head_dim=96, num_experts=8, top_k=2,
                        moe_intermediate_size=256, kv_lora_rank=128, q_lora_rank=128,
                        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                        n_shared_experts=1, first_k_dense_replace=0),
}


def _preset(name: str, **kw) -> ModelShape:
    with open(os.path.join(os.path.dirname(hardware_dir()), "plan_model", f"{name}.yaml")) as f:
        d = yaml.safe_load(f)
    return ModelShape.from_dict({**{k: v for k, v in d.items() if k != "name"}, **kw}, name)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bytes_equal_what_the_loader_allocates(family, fmt, dtype):
    cfg = ModelConfig(**CONFIGS[family])
    load = LoadConfig(load_format="dummy", dtype=dtype, quantization=fmt,
                      quantization_group_size=64)
    shape = dataclasses.replace(model_shape(cfg), quantization=fmt, quantization_group_size=64)
    tdt = getattr(torch, dtype)
    attn = weight_bytes(cfg, tdt, role="attention", load=load)
    experts = weight_bytes(cfg, tdt, load=load) - attn
    assert shape.num_layers * shape.num_experts * shape.expert_bytes(dtype) == pytest.approx(
        experts, rel=0.01)
    # attention side: routers kept in float32 and norms are the small differences
    assert shape.attention_side_bytes(dtype) == pytest.approx(attn, rel=0.03)


def test_bytes_per_weight_and_refusals():
    s = _preset("deepseek_v3")
    assert s.quant_weight_bytes("bfloat16") == 2
    assert dataclasses.replace(s, quantization="fp8").quant_weight_bytes() == 1 + 4 / 128**2
    assert dataclasses.replace(s, quantization="int8").quant_weight_bytes() == 1 + 2 / 7168
    assert dataclasses.replace(s, quantization="int4", quantization_group_size=32
                               ).quant_weight_bytes() == 0.5 + 4 / 32
    assert dataclasses.replace(s, quantization="fp8_dequant").quant_weight_bytes() == 2
    with pytest.raises(ConfigError, match="model.quantization='nf4'"):
        dataclasses.replace(s, quantization="nf4")
    with pytest.raises(ConfigError, match="model.quantization_group_size=48"):
        dataclasses.replace(s, quantization="int4", quantization_group_size=48)
    with pytest.raises(ConfigError, match="model.attn_unquantised_params"):
        dataclasses.replace(s, attn_unquantised_params=s.attn_params + 1)


def test_decode_reads_the_stored_bytes():
    hw = load_hardware("h200")
    s = _preset("qwen3_30b_a3b")
    t = {q: RooflineTimes(hw, dataclasses.replace(s, quantization=q), "bfloat16")
         for q in FORMATS}
    # one token per expert: weight-read bound, bytes halve (fp8, int8) and quarter (int4)
    e = {q: t[q].t_expert([1] * 16) - hw.kernel_overhead_s for q in FORMATS}
    assert e["fp8"] / e[None] == pytest.approx(0.5, rel=0.02)
    assert e["int8"] / e[None] == pytest.approx(0.5, rel=0.02)
    assert e["int4"] / e[None] == pytest.approx(0.5625 / 2, rel=0.02)
    a = {q: t[q].t_attn(1, 16) - hw.kernel_overhead_s for q in FORMATS}
    assert a["fp8"] < 0.6 * a[None]
    # prefill-sized batches are compute bound: fp8 runs on FP8 tensor cores, int8 does not
    big = {q: t[q].t_expert([8192]) - hw.kernel_overhead_s for q in FORMATS}
    assert big["fp8"] / big[None] == pytest.approx(0.5, rel=0.05)
    assert big["int8"] == pytest.approx(big[None], rel=0.01)


def test_deepseek_v3_fits_8xh200_in_fp8_not_bf16(tmp_path):
    hw, wl = load_hardware("h200"), Workload(1024, 512)
    space = SearchSpace(tpot_slo_s=0.15, max_devices=8)
    opt = PlanOptions(out_dir=str(tmp_path), timeline=False)
    lines = []
    res = run_plan(_preset("deepseek_v3", quantization="fp8"), [hw], wl, space, opt,
                   echo=lines.append)
    col = res["colocated"]
    assert col["plan"]["group"] == 8 and col["mem"] <= hw.mem_bytes * hw.mem_util
    out = "\n".join(lines)
    assert "weights: fp8" in out and "no disaggregated plan" in out
    room = [ln for ln in lines if "KV room left" in ln][0]
    weights = float(room.split("weights ")[1].split(" GiB")[0])
    assert 75 < weights < 90  # ~658 GiB / 8
    assert int(room.split(" = ")[1].split(" sequences")[0]) == col["plan"]["batch"] >= 256
    with pytest.raises(ModelTooLargeError) as e:
        run_plan(_preset("deepseek_v3"), [hw], wl, space, opt, echo=lambda s: None)
    msg = str(e.value)
    assert "weights in bfloat16: 1311 GiB" in msg and "model.quantization=fp8: 658.4 GiB" in msg
    assert "colocated" in msg and "usable capacity 127 GiB" in msg


def test_plan_cli_takes_the_format(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megainfer.launch.plan", "model=mixtral_8x7b",
                        "hardware=h100", "model.quantization=int8", "colocated=false",
                        f"out.dir={tmp_path}", "out.timeline=false", "top=1"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "weights: int8 (1.0005 B per quantised weight" in r.stdout
    assert "expert device" in r.stdout and "KV room left" in r.stdout
    assert json.load(open(tmp_path / "plans.json"))["plans"]


def test_world_plan_counts_the_format():
    shape = ModelShape("m", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                       head_dim=64, num_experts=4, top_k=2, moe_intermediate_size=512,
                       vocab_size=256)
    experts_fp32 = shape.num_layers * shape.num_experts * shape.expert_bytes("float32")
    hw = synthetic_hw(mem=0.4 * experts_fp32)  # 3 expert ranks of fp32 experts do not fit
    job = JobLoad(8, 8, Workload(16, 8))
    with pytest.raises(NoWorldPlanError):
        plan_world(shape, hw, job, 4, dtype="float32")
    ranked = plan_world(dataclasses.replace(shape, quantization="int8"), hw, job, 4,
                        dtype="float32")
    assert ranked and ranked[0].pred.mem_expert <= hw.mem_bytes


def test_job_shape_takes_the_format(tmp_path):
    hw = load_hardware("cpu_node")
    arch = {"family": "mixtral", "vocab_size": 64, "hidden_size": 64, "num_layers": 2,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "num_experts": 4, "top_k": 2,
            "moe_intermediate_size": 128}
    s = job_shape({"model": {"arch": arch, "quantization": "int4",
                             "quantization_group_size": 32}}, hw)
    assert (s.quantization, s.quantization_group_size) == ("int4", 32)
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    assert checkpoint_quantization(str(tmp_path)) == "fp8"
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_quantization(str(tmp_path)) is None
