"""Weight formats (kernels/weight_quant.py) and their CPU compute paths (kernels/cpu_qgemm.py):
quantisers against per-element definitions, every compute path against ``qlinear_ref`` (the
dequantised weight in float32), and each format's error against the float weight."""
import pytest
import torch

from megainfer.kernels.cpu_qgemm import dequantize_fp8_blocks, qlinear
from megainfer.kernels.weight_quant import (QuantizedWeight, WeightFormat, dequantize,
                                            dequantize_int4_values, quantize, quantize_act_fp8,
                                            quantize_int4_values, qlinear_ref)

FORMATS = [WeightFormat("fp8", block=(32, 32)), WeightFormat("fp8"),
           WeightFormat("int8"), WeightFormat("int4", group_size=32),
           WeightFormat("int4", group_size=64)]
IDS = ["fp8-32", "fp8-128", "int8", "int4-g32", "int4-g64"]


def _w(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) / K ** 0.5


def _qw(w, fmt, dtype=torch.float32):
    data, scale = quantize(w, fmt, fmt.scale_dtype(dtype))
    return QuantizedWeight(data, scale, fmt, tuple(w.shape))


def test_fp8_blocks_per_element():
    fmt = WeightFormat("fp8", block=(32, 32))
    w = _w(48, 80)  # partial edge blocks in both dims
    qw = _qw(w, fmt)
    assert qw.data.dtype == torch.float8_e4m3fn and qw.scale.shape == (2, 3)
    deq = dequantize(qw)
    for i, j in [(0, 0), (31, 31), (32, 33), (47, 79), (40, 64)]:
        assert deq[i, j] == qw.data[i, j].float() * qw.scale[i // 32, j // 32]
    assert torch.equal(dequantize_fp8_blocks(qw.data, qw.scale, (32, 32), torch.float32), deq)
    # a block's largest element maps to the format's max: scale = amax / 448
    assert torch.allclose(qw.scale[0, 0], w[:32, :32].abs().max() / 448.0)


def test_int8_per_channel_definition():
    w = _w(32, 64)
    qw = _qw(w, WeightFormat("int8"))
    assert qw.data.dtype == torch.int8 and qw.scale.shape == (32,)
    assert torch.equal(qw.data.abs().amax(1), torch.full((32,), 127, dtype=torch.int8))
    assert torch.equal(dequantize(qw), qw.data.float() * qw.scale[:, None])


@pytest.mark.parametrize("G", [32, 64])
def test_int4_pack_roundtrip(G):
    """The stored (packed) int4 weight dequantises to (q - 8) * scale + zero of its values."""
    w = _w(32, 128)
    q, sz = quantize_int4_values(w, G)
    assert int(q.min()) >= 0 and int(q.max()) <= 15 and sz.shape == (128 // G, 32, 2)
    qw = _qw(w, WeightFormat("int4", group_size=G))
    assert qw.data.dtype == torch.uint8 and qw.data.shape == (32, 64)
    # the op computes the same affine map in another order: equal to float32 rounding
    assert torch.allclose(dequantize(qw), dequantize_int4_values(q, sz, G), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_format_error_is_small(fmt):
    w = _w(128, 256)
    err = (dequantize(_qw(w, fmt)) - w).abs().max() / w.abs().max()
    assert float(err) < {"fp8": 0.07, "int8": 0.005, "int4": 0.07}[fmt.name]


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("T", [0, 1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qlinear_matches_reference(fmt, T, dtype):
    N, K = 64, 128
    qw = _qw(_w(N, K, seed=T), fmt, dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    y = qlinear(x, qw, bias)
    assert y.dtype == dtype and y.shape == (T, N)
    ref = qlinear_ref(x, qw, bias)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(y.float(), ref, atol=tol, rtol=tol), (y.float() - ref).abs().max()


def test_qlinear_keeps_leading_dims():
    qw = _qw(_w(32, 64), WeightFormat("int8"))
    x = torch.randn(2, 3, 64)
    assert torch.allclose(qlinear(x, qw), qlinear_ref(x.reshape(6, 64), qw).view(2, 3, 32),
                          atol=1e-5)


def test_act_quant_is_per_token_group():
    x = torch.tensor([[1.0, 2.0, 1000.0, 3.0], [0.5, 0.25, 0.125, 448.0]])
    xq = quantize_act_fp8(x, group=2)
    # each row's groups of 2 have their own scale: the large value in group 2 of row 0 does not
    # coarsen group 1
    assert torch.equal(xq[0, :2], x[0, :2]) and torch.equal(xq[1], x[1])


def test_stacked_expert_index():
    fmt = WeightFormat("int4", group_size=32)
    w = torch.stack([_w(32, 64, seed=s) for s in range(3)])  # [E, N, K]
    data, scale = quantize(w, fmt)
    qw = QuantizedWeight(data, scale, fmt, tuple(w.shape))
    assert data.shape == (3, 32, 32) and scale.shape == (3, 2, 32, 2)
    for e in range(3):
        assert torch.equal(qw[e].data, _qw(w[e], fmt).data)
        assert torch.equal(qw[e].dequantize(), dequantize(_qw(w[e], fmt)))


def test_format_refusals():
    with pytest.raises(ValueError, match="group_size"):
        WeightFormat("int4", group_size=16)
    assert "multiple of 16" in WeightFormat("int4", group_size=32).shape_error(24, 64)
    assert "quantization_group_size=64" in WeightFormat("int4").shape_error(32, 96)
    assert WeightFormat("int8").shape_error(24, 7) is None
