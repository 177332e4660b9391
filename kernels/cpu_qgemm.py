"""``y = x @ W.T`` with W kept in its stored format (``weight_quant.py``), on CPU and, through
the dequantising paths, on any device torch runs: a dequantised copy lives only for the call.

* ``int8``: on CPU (fp32 or bf16 activations) ``aten._weight_int8pack_mm`` or the data cast
  for the call, F.linear and the scale on the output, as ``cpu_qgemm_rules`` measured faster
  for the rows and threads; elsewhere data * scale, then F.linear.
* ``int4``: ``aten._weight_int4pack_mm_for_cpu`` or the weight dequantised for the call
  (``dequantize_int4_cpu_t``), by the same rules (CPU only: the stored layout is that op's).
* ``fp8``: on cuda ``triton_fp8_gemm.fp8_block_linear``; elsewhere activations quantised the
  same way, the weight dequantised block by block into the compute dtype, then F.linear.

Every path is tested against ``weight_quant.qlinear_ref``.
docs/checkpoints.md, "Weight formats" (Compute).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .cpu_gemm import cached_on, storage_key
from .cpu_qgemm_rules import method_for
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
    """x2 [T, K] @ W.T -> [T, N]: the weight-only kernel or, per ``cpu_qgemm_rules``, the
    int8 data cast to x's dtype for this call, F.linear, then the per-channel scale on the
    output (``(x @ q.T) * s == x @ (q * s).T``)."""
    if x2.is_cpu and x2.dtype in (torch.float32, torch.bfloat16):
        scale = qw.scale if qw.scale.dtype == x2.dtype else qw.scale.to(x2.dtype)
        if method_for("int8", x2.dtype, x2.shape[0]) == "weight_only":
            return torch.ops.aten._weight_int8pack_mm(x2.contiguous(), qw.data, scale)
        return F.linear(x2, qw.data.to(x2.dtype)).mul_(scale)
    w = qw.data.to(x2.dtype) * qw.scale.to(x2.dtype)[:, None]  # [N, K], this call only
    return F.linear(x2, w)


def dequantize_int4_cpu_t(data: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch's CPU int4 layout, data uint8 [N, K/2] (N % 64 == 0), scale_zeros [K/G, N, 2] ->
    W.T [K, N] in ``dtype`` (transposed: the layout's own order, and the scales' [K/G, N]),
    (q - 8) * scale + zero computed in float32, then one cast. The layout, as
    ``_convert_weight_to_int4pack_for_cpu`` writes it: blocks of 64 rows of W, each [K, 32]
    bytes, byte b of column k holding row b of the block in its low, row 32 + b in its high
    nibble."""
    N, K, G = data.shape[0], data.shape[1] * 2, group_size
    p = data.view(N // 64, K, 32).transpose(0, 1)  # [K, N/64, 32]
    wt = torch.empty(K, N // 64, 2, 32, dtype=torch.float32, device=data.device)
    wt[:, :, 0].copy_(p & 15)
    wt[:, :, 1].copy_(p >> 4)
    s = scale_zeros[..., 0].float()  # [K/G, N]
    c = scale_zeros[..., 1].float() - 8.0 * s  # (q - 8) * s + z = q * s + (z - 8 s)
    wt = wt.view(K // G, G, N).mul_(s[:, None]).add_(c[:, None]).view(K, N)
    return wt if dtype == torch.float32 else wt.to(dtype)


def _int4(x2: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x2 [T, K] @ W.T -> [T, N]: the weight-only kernel (fp32 or bf16 activations; others
    through fp32) or, per ``cpu_qgemm_rules``, W dequantised for this call then F.linear."""
    if qw.fmt.int4_layout != "torch_cpu" or not x2.is_cpu:  # the Triton layout: this call only
        return F.linear(x2, qw.dequantize(x2.dtype))
    sz = qw.scale if qw.scale.dtype == x2.dtype else qw.scale.to(x2.dtype)
    if x2.dtype not in (torch.float32, torch.bfloat16):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.float().contiguous(), qw.data,
                                                       qw.fmt.group_size, sz.float())
        return y.to(x2.dtype)
    if qw.shape[-2] % 64 == 0 and method_for("int4", x2.dtype, x2.shape[0]) == "dequant":
        return torch.mm(x2, dequantize_int4_cpu_t(qw.data, qw.scale, qw.fmt.group_size,
                                                  x2.dtype))
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
    x2 = x if x.dim() == 2 else x.reshape(-1, K)  # [T, K]
    if x2.shape[0] == 0:
        y = x2.new_zeros(0, qw.shape[-2])
    else:
        y = _PATHS[qw.fmt.name](x2, qw)
    if bias is not None:
        y = y + bias
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


_ATTR_CAT = "_megainfer_qcat"


def _concat_ok(qws: Sequence[QuantizedWeight]) -> bool:
    """Whether stored weights [N_i, K] concatenate along N into one stored weight: int8 always
    (rows and their scales), torch_cpu int4 when every N_i is whole 64-row layout blocks."""
    f = qws[0].fmt
    if any(q.fmt != f or q.dim() != 2 or q.shape[1] != qws[0].shape[1] for q in qws):
        return False
    if f.name == "int8":
        return True
    return f.name == "int4" and f.int4_layout == "torch_cpu" and all(
        q.shape[0] % 64 == 0 for q in qws)


def qlinear_split(x: torch.Tensor, qws: Sequence[QuantizedWeight],
                  biases: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """[qlinear(x, w, b) for w, b in zip(qws, biases)]: x [T, K], qws[i] [N_i, K] -> [T, N_i]
    each, as views of one ``qlinear`` over the weights concatenated along N (data, scales and
    biases copied once, cached on ``qws[0].data`` for its storage and version) when
    ``_concat_ok``; otherwise one call per weight."""
    if not _concat_ok(qws) or x.dim() != 2:
        return [qlinear(x, w, b) for w, b in zip(qws, biases)]

    def build():
        data = torch.cat([q.data for q in qws])  # [sum N_i, K or K/2]
        dim = 0 if qws[0].fmt.name == "int8" else 1  # int4 scale_zeros [K/G, N, 2]
        scale = torch.cat([q.scale for q in qws], dim=dim)
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else data.new_zeros(q.shape[0], dtype=x.dtype)
             for b, q in zip(biases, qws)])
        n = sum(q.shape[0] for q in qws)
        return QuantizedWeight(data, scale, qws[0].fmt, (n, qws[0].shape[1])), bias

    key = tuple(storage_key(t) for q in qws for t in (q.data, q.scale))
    key += tuple(None if b is None else storage_key(b) for b in biases)
    w, bias = cached_on(qws[0].data, _ATTR_CAT, key, build)
    y = qlinear(x, w, bias)  # [T, sum N_i]
    return list(y.split([q.shape[0] for q in qws], dim=-1))


def stacked_qlinear(w: QuantizedWeight) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A stacked quantised weight [E, N, K] -> ``run(x, e)``: x [n, K] @ W[e].T -> [n, N]
    (``cpu_gemm.stacked_linear``'s contract: the MoE expert loop)."""
    return lambda x, e: qlinear(x, w[e])
