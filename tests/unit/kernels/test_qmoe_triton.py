"""The Triton grouped GEMMs on weights kept in int8, int4 (nibbles) and fp8 (block scales,
per-token-group activations), dequantised in the tile, against the torch path on the same
stored weights (kernels/torch_moe.py over cpu_qgemm) and the float reference on the
dequantised weights; under TRITON_INTERPRET at small shapes."""
import pytest
import torch
import triton
import triton.language as tl

from megainfer.kernels import fused_moe, fused_moe_ref
from megainfer.kernels.triton_qweights import fp8_round
from megainfer.kernels.weight_quant import (QuantizedWeight, WeightFormat, quantize,
                                            quantize_act_fp8)

FMTS = {"int8": WeightFormat("int8"), "int4": WeightFormat("int4", group_size=32,
                                                          int4_layout="nibbles"),
        "fp8": WeightFormat("fp8", block=(32, 32))}


def _moe(M, E, k, N, K, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w1 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5
    w2 = torch.randn(E, K, N, generator=g) / N ** 0.5
    w, ids = torch.topk(torch.softmax(torch.randn(M, E, generator=g), -1), k, dim=-1)
    return x, w1, w2, w, ids


def _q(w, fmt, dtype):
    data, scale = quantize(w, fmt, fmt.scale_dtype(dtype))
    return QuantizedWeight(data, scale, fmt, tuple(w.shape))


def _ref_fp8(x, q1, q2, w, ids, group):
    """Per token and expert: both GEMM inputs quantised per token per group, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    d1, d2 = q1.dequantize(), q2.dequantize()
    N = d2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = quantize_act_fp8(x[t:t + 1].float(), group) @ d1[e].t()
            a = torch.nn.functional.silu(gu[:, :N]) * gu[:, N:]
            out[t] += float(w[t, j]) * (quantize_act_fp8(a, group) @ d2[e].t())[0]
    return out


@pytest.mark.parametrize("fmt", sorted(FMTS))
@pytest.mark.parametrize("M,E,k", [(1, 4, 2), (7, 4, 2), (20, 6, 3)])
def test_quantised_triton_matches_torch_path(fmt, M, E, k):
    N, K = 64, 96  # K: three 32-wide groups / blocks; fp8 row blocks split gate from up
    x, w1, w2, w, ids = _moe(M, E, k, N, K, seed=M + E, dtype=torch.float32)
    q1, q2 = _q(w1, FMTS[fmt], torch.float32), _q(w2, FMTS[fmt], torch.float32)
    got = fused_moe(x, q1, q2, w, ids, backend="triton")
    torch_path = fused_moe(x, q1, q2, w, ids, backend="torch")
    assert torch.allclose(got, torch_path, atol=1e-4, rtol=1e-4), (got - torch_path).abs().max()
    if fmt == "fp8":
        ref = _ref_fp8(x, q1, q2, w, ids, 32)
    else:
        ref = fused_moe_ref(x, q1.dequantize(), q2.dequantize(), w, ids)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


@pytest.mark.parametrize("fmt", sorted(FMTS))
def test_quantised_triton_bf16_and_absent_experts(fmt):
    M, E, k, N, K = 9, 6, 2, 32, 64
    x, w1, w2, w, ids = _moe(M, E, k, N, K, seed=3, dtype=torch.bfloat16)
    here = torch.tensor([0, 2, 3, 5])
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[here] = torch.arange(4, dtype=torch.int32)
    q1, q2 = _q(w1[here], FMTS[fmt], torch.bfloat16), _q(w2[here], FMTS[fmt], torch.bfloat16)
    got = fused_moe(x, q1, q2, w, ids, emap, backend="triton")
    ref = fused_moe(x, q1, q2, w, ids, emap, backend="torch")
    assert got.dtype == torch.bfloat16
    # fp8: the torch path computes silu(gate) * up in bf16, the kernel in fp32 then rounds it
    # to bf16; an intermediate one bf16 ulp apart can land in the next fp8 step (1/8 relative)
    tol = 0.1 if fmt == "fp8" else 3e-2
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol), \
        (got.float() - ref.float()).abs().max()


@triton.jit
def _round_kernel(x_ptr, y_ptr, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(y_ptr + o, fp8_round(tl.load(x_ptr + o), 3, -6, 448.0))


def test_fp8_activation_rounding_is_exact():
    """The in-tile fp8 rounding (fp32 arithmetic) equals torch's float8 cast, ties and binade
    edges included (the interpreter's own cast is off there)."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([(torch.randn(4000, generator=g) * 60).clamp(-448, 448),
                   torch.tensor([0.0, 448.0, -448.0, 2 ** -9, 3 * 2 ** -10, 1.0625, 1.1875,
                                 15.5, 127.9, 2 ** -7 * 1.03, -0.0])])
    x = torch.nn.functional.pad(x, (0, 4096 - x.numel()))
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, B=4096)
    assert torch.equal(y, x.to(torch.float8_e4m3fn).float())


def test_int4_cpu_layout_refused_on_triton():
    from megainfer.kernels.entry_points import KernelInputError
    x, w1, w2, w, ids = _moe(2, 4, 2, 32, 64, seed=0, dtype=torch.float32)
    fmt = WeightFormat("int4", group_size=32)
    with pytest.raises(KernelInputError, match="nibbles"):
        fused_moe(x, _q(w1, fmt, torch.float32), _q(w2, fmt, torch.float32), w, ids,
                  backend="triton")
