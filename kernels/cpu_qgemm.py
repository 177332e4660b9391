"""``y = x @ W.T`` with W kept in its stored format (``weight_quant.py``), on CPU and, through
the dequantising paths, on any device torch runs: a dequantised copy lives only for the call.

* ``int8``: ``aten._weight_int8pack_mm`` on CPU (x and scale in one dtype, fp32 or bf16);
  elsewhere data * scale, then F.linear.
* ``int4``: ``aten._weight_int4pack_mm_for_cpu`` (CPU only: the stored layout is that op's).
* ``fp8``: on cuda ``triton_fp8_gemm.fp8_block_linear``; elsewhere activations quantised the
  same way, the weight dequantised block by block into the compute dtype, then F.linear.

Every path is tested against ``weight_quant.qlinear_ref``.
docs/checkpoints.md, "Weight formats" (Compute).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .weight_quant import QuantizedWeight, quantize_act_fp8


def dequantize_fp8_blocks(data: torch.Tensor, scale_inv: torch.Tensor, block,
                          dtype: torch.dtype = torch.float32, row0: int = 0) -> torch.Tensor:
    """data [..., N, K] float8, scale_inv [..., ceil(N/bo), ceil(K/bi)] -> W [..., N, K] in
    ``dtype``: a float32 copy scaled in place block row by block row (the scale widened to
    [..., rows of blocks, K] only, no full-size scale), then one cast. Edge blocks may be
    partial. ``row0``: ``data`` holds rows ``[row0, row0 + N)`` of dim -2 of the full weight
    and ``scale_inv`` the block rows they touch (``row0 // bo`` on), so a slice that does not
    start on a block boundary is scaled like the full tensor."""
    bo, bi = int(block[0]), int(block[1])
    out = data.to(torch.float32)
    if out is data:  # already float32 (a test feeding floats): never scale the caller's tensor
        out = data.clone()
    rows, cols = out.shape[-2], out.shape[-1]
    s = scale_inv.to(torch.float32).repeat_interleave(bi, dim=-1)[..., :cols]  # [..., R, cols]
    r, k = 0, 0
    head = min(rows, (-row0) % bo)  # rows before the slice's first block boundary
    if head:
        out[..., :head, :].mul_(s[..., :1, :])
        r, k = head, 1
    full = (rows - r) // bo
    if full:
        out[..., r:r + full * bo, :].unflatten(-2, (full, bo)).mul_(s[..., k:k + full, None, :])
        r, k = r + full * bo, k + full
    if r < rows:  # a partial last block
        out[..., r:, :].mul_(s[..., k:k + 1, :])
    return out if dtype == torch.float32 else out.to(dtype)


def _int8(x2: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    if x2.is_cpu and x2.dtype in (torch.float32, torch.bfloat16):
        scale = qw.scale if qw.scale.dtype == x2.dtype else qw.scale.to(x2.dtype)
        return torch.ops.aten._weight_int8pack_mm(x2.contiguous(), qw.data, scale)
    w = qw.data.to(x2.dtype) * qw.scale.to(x2.dtype)[:, None]  # [N, K], this call only
    return F.linear(x2, w)


def _int4(x2: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    if qw.fmt.int4_layout != "torch_cpu" or not x2.is_cpu:  # the Triton layout: this call only
        return F.linear(x2, qw.dequantize(x2.dtype))
    sz = qw.scale if qw.scale.dtype == x2.dtype else qw.scale.to(x2.dtype)
    if x2.dtype not in (torch.float32, torch.bfloat16):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.float().contiguous(), qw.data,
                                                       qw.fmt.group_size, sz.float())
        return y.to(x2.dtype)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), qw.data,
                                                      qw.fmt.group_size, sz)


def _fp8(x2: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    bi = qw.fmt.block[1]
    if x2.is_cuda and bi >= 16 and bi & (bi - 1) == 0:  # the block-scaled fp8 Triton GEMM
        from .triton_fp8_gemm import fp8_block_linear  # Triton: imported on cuda only
        return fp8_block_linear(x2, qw)
    xq = quantize_act_fp8(x2, bi, qw.fmt.fp8_dtype)  # [T, K] in x's dtype
    return F.linear(xq, dequantize_fp8_blocks(qw.data, qw.scale, qw.fmt.block, x2.dtype))


_PATHS: dict[str, Callable] = {"int8": _int8, "int4": _int4, "fp8": _fp8}


def qlinear(x: torch.Tensor, qw: QuantizedWeight,
            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in x's dtype, W = ``qw`` as stored."""
    K = qw.shape[-1]
    x2 = x.reshape(-1, K)  # [T, K]
    if x2.shape[0] == 0:
        y = x2.new_zeros(0, qw.shape[-2])
    else:
        y = _PATHS[qw.fmt.name](x2, qw)
    if bias is not None:
        y = y + bias
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def stacked_qlinear(w: QuantizedWeight) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A stacked quantised weight [E, N, K] -> ``run(x, e)``: x [n, K] @ W[e].T -> [n, N]
    (``cpu_gemm.stacked_linear``'s contract: the MoE expert loop)."""
    return lambda x, e: qlinear(x, w[e])
