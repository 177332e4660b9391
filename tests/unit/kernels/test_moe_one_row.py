"""The one-row MoE path (kernels/torch_moe.py ``one_row_moe``, a decode step of one sequence)
against the grouped path on the same row, bit for bit, in every weight format and dtype, and
against the float reference."""
import pytest
import torch

from megainfer.kernels import cpu_moe_rules
from megainfer.kernels.torch_moe import fused_moe_torch, grouped_moe, one_row_moe
from megainfer.kernels.weight_quant import QuantizedWeight, WeightFormat, quantize

E, N, K = 6, 64, 128


def _weights(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5
    w2 = torch.randn(E, K, N, generator=g) / N ** 0.5
    if fmt is None:
        return w1.to(dtype), w2.to(dtype), w1, w2
    f = WeightFormat(fmt, group_size=32)
    q1, q2 = quantize(w1, f, dtype), quantize(w2, f, dtype)
    return (QuantizedWeight(*q1, f, tuple(w1.shape)), QuantizedWeight(*q2, f, tuple(w2.shape)),
            QuantizedWeight(*q1, f, tuple(w1.shape)).dequantize(),
            QuantizedWeight(*q2, f, tuple(w2.shape)).dequantize())


@pytest.mark.parametrize("fmt", [None, "int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_one_row_equals_grouped(fmt, dtype, k):
    w1, w2, f1, f2 = _weights(fmt, dtype)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(1, K, generator=g).to(dtype)
    ids = torch.randperm(E, generator=g)[:k].view(1, k)
    tw = torch.rand(1, k, generator=g).to(dtype)
    got = one_row_moe(x, w1, w2, tw, ids)
    assert torch.equal(got, grouped_moe(x, w1, w2, tw, ids, None))
    with cpu_moe_rules.use_rules(cpu_moe_rules.forced("per_expert")):  # not the measured pick
        assert torch.equal(fused_moe_torch(x, w1, w2, tw, ids), got)
    # the float reference over the dequantised weights
    ref = sum(float(tw[0, j]) * (torch.nn.functional.silu(x.float() @ f1[e, :N].t()) *
                                 (x.float() @ f1[e, N:].t())) @ f2[e].t()
              for j, e in enumerate(ids[0].tolist()))
    tol = 1e-4 if dtype == torch.float32 and fmt != "fp8" else 6e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
