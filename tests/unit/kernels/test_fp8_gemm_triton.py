"""The block-scaled FP8 dense GEMM (kernels/triton_fp8_gemm.py) against its torch references
(weight_quant.quantize_act_fp8_scaled, qlinear_ref): the per-token-group activation quantiser
bit for bit, the GEMM within float32 summation order, edge blocks and strides included; under
TRITON_INTERPRET at small shapes (blocks of 32 or 16 x 32 instead of 128 x 128); compiled on
cuda when the interpreter is off (perf/gpu_session.sh, step fp8): there the fp8 tensor cores'
accumulation is looser than float32's, hence the wider tolerance."""
import os

import pytest
import torch

from megainfer.kernels.triton_fp8_gemm import (fp8_block_linear, quant_act_fp8_triton,
                                               w8a8_block_fp8_matmul)
from megainfer.kernels.weight_quant import (QuantizedWeight, WeightFormat, qlinear_ref,
                                            quantize, quantize_act_fp8_scaled)

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"
TOL = 1e-5 if INTERP else 3e-3
pytestmark = pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                reason="Triton needs TRITON_INTERPRET=1 or a GPU")


def _qw(N, K, block, fp8, seed=0):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) / K ** 0.5
    fmt = WeightFormat("fp8", block=block, fp8_dtype=fp8)
    data, scale = quantize(w, fmt)
    return QuantizedWeight(data, scale, fmt, (N, K))


def _on(qw):
    return QuantizedWeight(qw.data.to(DEV), qw.scale.to(DEV), qw.fmt, qw.shape)


@pytest.mark.parametrize("M,K,group", [(1, 64, 32), (5, 80, 32), (3, 128, 64), (2, 48, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", FP8)
def test_activation_quantiser_matches_torch(M, K, group, dtype, fp8):
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(M + K)) * 3).to(dtype)
    x[0, :3] = 0.0  # zeros and a tiny group stay exact
    q, s = (t.cpu() for t in quant_act_fp8_triton(x.to(DEV), group, fp8))
    rq, rs = quantize_act_fp8_scaled(x, group, fp8)
    assert q.dtype == fp8 and s.shape == rs.shape
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    torch.testing.assert_close(q.float(), rq.float(), rtol=0, atol=0)


@pytest.mark.parametrize("M,N,K", [(1, 64, 64), (7, 48, 96), (33, 80, 64), (4, 32, 200)])
@pytest.mark.parametrize("block", [(32, 32), (16, 32), (64, 16)])
@pytest.mark.parametrize("fp8", FP8)
def test_gemm_matches_reference(M, N, K, block, fp8):
    qw = _qw(N, K, block, fp8, seed=N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    xq, xs = quant_act_fp8_triton(x.to(DEV), block[1], fp8)
    y = w8a8_block_fp8_matmul(xq, xs, qw.data.to(DEV), qw.scale.to(DEV), block, torch.float32)
    ref = qlinear_ref(x, qw)
    torch.testing.assert_close(y.cpu(), ref, rtol=TOL, atol=TOL)


def test_linear_bf16_bias_leading_dims_and_strides():
    qw = _qw(96, 64, (32, 32), torch.float8_e4m3fn)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16)
    y = fp8_block_linear(x.to(DEV), _on(qw), b.to(DEV)).cpu()
    assert y.shape == (2, 3, 96) and y.dtype == torch.bfloat16
    ref = qlinear_ref(x.reshape(6, 64), qw, b).reshape(2, 3, 96)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    wide = torch.randn(5, 128)[:, ::2]  # a strided activation view
    xq, xs = quant_act_fp8_triton(wide.to(DEV), 32)
    y2 = w8a8_block_fp8_matmul(xq, xs, qw.data.to(DEV), qw.scale.to(DEV), (32, 32),
                               torch.float32).cpu()
    torch.testing.assert_close(y2, qlinear_ref(wide, qw), rtol=TOL, atol=TOL)


def test_empty_and_misfit_operands():
    qw = _on(_qw(32, 64, (32, 32), torch.float8_e4m3fn))
    assert fp8_block_linear(torch.zeros(0, 64, device=DEV), qw).shape == (0, 32)
    xq, xs = quant_act_fp8_triton(torch.randn(2, 64, device=DEV), 32)
    with pytest.raises(ValueError, match="do not fit block"):
        w8a8_block_fp8_matmul(xq, xs, qw.data, qw.scale, (32, 16))
    with pytest.raises(ValueError, match="BLOCK_K=16"):
        w8a8_block_fp8_matmul(xq, xs, qw.data, qw.scale, (32, 32),
                              config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=1))


@pytest.mark.gpu
def test_cuda_linear_takes_the_kernel():
    from megainfer.kernels.cpu_qgemm import qlinear
    qw = _qw(256, 512, (128, 128), torch.float8_e4m3fn)
    x = torch.randn(8, 512, dtype=torch.bfloat16)
    y = qlinear(x.cuda(), QuantizedWeight(qw.data.cuda(), qw.scale.cuda(), qw.fmt, qw.shape))
    ref = qlinear_ref(x.float(), qw)
    torch.testing.assert_close(y.float().cpu(), ref, rtol=2e-2, atol=2e-2)
