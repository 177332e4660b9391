"""Weights kept in their format (``model.quantization``; models/quant_weights.py,
quant_load.py): online fp8/int8/int4 on every family, against the model's dequantised twin
(the reference that quantises the same way) and within the top-k of the fp32 model; stored
dtypes and bytes; refusals named."""
import pytest
import torch

from megainfer.config import ConfigError
from megainfer.models.quant_load import weight_bytes_by_kind
from megainfer.models.quant_linear import QuantLinear

from quant_util import SHAPES, build, dequantised_twin, logits, make

FORMATS = ("fp8", "int8", "int4")
PROMPT = [1, 5, 9, 33, 70, 4, 100, 17]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {f: make(f, root) for f in SHAPES}


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_online_format_matches_twin(ckpts, family, fmt):
    path = ckpts[family]
    q = build(path, quantization=fmt, quantization_group_size=32)
    store = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.uint8}[fmt]
    qlins = [m for m in q.modules() if isinstance(m, QuantLinear)]
    assert qlins and all(m.weight.dtype == store for m in qlins)
    experts = [m for m in q.modules() if getattr(m, "weight_format", None) is not None]
    assert experts and all(m.gate_up_proj.dtype == store for m in experts)
    assert q.lm_head.weight.dtype == torch.float32  # lm_head and embeddings stay model dtype
    if family == "deepseek_v3":  # kv_b_proj stays model dtype (absorbed decode reads it)
        assert not isinstance(q.layers[0].self_attn.kv_b_proj, QuantLinear)
    got = logits(q, PROMPT)
    ref = logits(dequantised_twin(q, path), PROMPT)
    assert torch.allclose(got, ref, atol=2e-4, rtol=1e-4), (got - ref).abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_bytes_shrink(ckpts, fmt):
    path = ckpts["qwen3_moe"]
    full = weight_bytes_by_kind(build(path))
    assert full["quantised"] == 0
    q = weight_bytes_by_kind(build(path, quantization=fmt, quantization_group_size=32))
    ratio = (full["other"] - q["other"]) / q["quantised"]  # those weights' fp32 bytes / stored
    # fp32 -> 1 byte (+ one fp32 scale per 128x128 block, or per row) / half a byte
    assert {"fp8": 3.5, "int8": 3.5, "int4": 5.0}[fmt] < ratio <= {"fp8": 4, "int8": 4,
                                                                   "int4": 8}[fmt]


def test_bf16_compute(ckpts):
    """model.dtype=bfloat16 on cpu, unquantised and int8: close to fp32's logits."""
    path = ckpts["mixtral"]
    ref = logits(build(path), PROMPT)
    for q in (None, "int8"):
        got = logits(build(path, dtype="bfloat16", quantization=q), PROMPT)
        assert got.dtype == torch.float32
        assert (got - ref).abs().max() < 0.15


def test_int4_shape_refused_before_loading(tmp_path):
    from megainfer.tools.make_tiny import make_tiny
    d = make_tiny("deepseek_v3", str(tmp_path / "ds"), seed=0)  # kv_a_proj: 32 + 8 = 40 rows
    with pytest.raises(ConfigError, match=r"model.quantization=int4: .*kv_a_proj_with_mqa"
                                          r".*multiple of 16"):
        build(d, quantization="int4", quantization_group_size=32)


def test_group_size_refused(ckpts):
    with pytest.raises(ConfigError, match="model.quantization_group_size=16"):
        build(ckpts["mixtral"], quantization="int4", quantization_group_size=16)
    with pytest.raises(ConfigError, match="model.quantization='int3'"):
        build(ckpts["mixtral"], quantization="int3")
