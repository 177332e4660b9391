"""Block-scaled FP8 dense GEMM (vLLM's / SGLang's ``w8a8_block_fp8_matmul``): the cuda path of
an fp8 linear weight (``cpu_qgemm.qlinear``); torch references ``weight_quant.quantize_act_fp8_scaled``
and ``weight_quant.qlinear_ref``. Row-major, any strides:

* ``quant_act_fp8_triton``: x [M, K] fp32/bf16/fp16 -> xq [M, K] float8, xs [M, ceil(K/group)]
  float32 (per token per ``group`` columns).
* ``w8a8_block_fp8_matmul``: wq [N, K] float8, ws [ceil(N/BO), ceil(K/BI)] float32, xs's group
  = BI -> y [M, N] in ``out_dtype``, accumulated in float32, one K tile per BI block.
* ``fp8_block_linear(x, qw, bias)``: x [..., K] -> y [..., N] in x's dtype, both steps.
docs/kernels.md, "Block-scaled FP8 dense GEMM (Triton)".
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .tile_configs import interpreting
from .triton_qweights import FP8_GRID, fp8_round
from .weight_quant import QuantizedWeight, cdiv


@triton.jit
def _act_quant(x_ptr, q_ptr, s_ptr, K, s_xm, s_xk, s_qm, s_qk, s_sm, s_sg,
               GROUP: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
               FMAX: tl.constexpr):
    """One (token, group): its scale and its fp8 values."""
    m, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    ok = offs < K
    x = tl.load(x_ptr + m * s_xm + offs * s_xk, mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0) / FMAX, 1e-12)
    q = fp8_round(x / s, MANT, EMIN, FMAX)  # exactly representable: the cast is exact
    tl.store(q_ptr + m * s_qm + offs * s_qk, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + m * s_sm + g * s_sg, s)


@triton.jit
def _w8a8_block(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                s_am, s_ak, s_asm, s_ask, s_bn, s_bk, s_bsn, s_bsk, s_cm, s_cn,
                BO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FP8_DOT: tl.constexpr):
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n  # grouped ordering: GROUP_M row blocks share weight tiles in L2
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    offs_m64, offs_n64 = offs_m.to(tl.int64), offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + offs_m64[:, None] * s_am + offs_k[None, :] * s_ak,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK] fp8
        b = tl.load(b_ptr + offs_n64[None, :] * s_bn + offs_k[:, None] * s_bk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN] fp8
        sa = tl.load(as_ptr + offs_m64 * s_asm + kb * s_ask, mask=m_ok, other=0.0)  # [BM]
        sb = tl.load(bs_ptr + (offs_n64 // BO) * s_bsn + kb * s_bsk, mask=n_ok, other=0.0)
        if FP8_DOT:
            part = tl.dot(a, b)
        else:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        acc += part * sa[:, None] * sb[None, :]
    tl.store(c_ptr + offs_m64[:, None] * s_cm + offs_n64[None, :] * s_cn,
             acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _fp8_dot(device: torch.device) -> bool:
    """fp8 tensor cores: cuda devices of compute capability >= 8.9, not the interpreter."""
    if interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quant_act_fp8_triton(x: torch.Tensor, group: int,
                         fp8_dtype: torch.dtype = torch.float8_e4m3fn):
    """x [M, K] -> (xq [M, K] ``fp8_dtype``, xs [M, ceil(K/group)] float32); ``group`` a power
    of two."""
    M, K = x.shape
    xq = torch.empty(M, K, dtype=fp8_dtype, device=x.device)
    xs = torch.empty(M, cdiv(K, group), dtype=torch.float32, device=x.device)
    if M:
        mant, emin, fmax = FP8_GRID[fp8_dtype]
        _act_quant[(M, cdiv(K, group))](x, xq, xs, K, *x.stride(), *xq.stride(), *xs.stride(),
                                        GROUP=group, MANT=mant, EMIN=emin, FMAX=fmax)
    return xq, xs


def gemm_config(M: int, N: int, device: torch.device, block_k: int) -> dict:
    """Tiles: BLOCK_K = the scale block's width; small M (decode) narrow row tiles."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, GROUP_M=4)
    bm = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 128 else 128
    return dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8,
                num_warps=4 if bm <= 64 else 8, num_stages=3)


def w8a8_block_fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor,
                          ws: torch.Tensor, block, out_dtype: torch.dtype = torch.bfloat16,
                          config: Optional[dict] = None) -> torch.Tensor:
    """y [M, N] = (xq * xs) @ (wq * ws).T block by block (module docstring)."""
    M, K = xq.shape
    N, K2 = wq.shape
    bo, bi = int(block[0]), int(block[1])
    if K2 != K or xs.shape != (M, cdiv(K, bi)) or ws.shape != (cdiv(N, bo), cdiv(K, bi)):
        raise ValueError(f"w8a8_block_fp8_matmul: xq {tuple(xq.shape)}, xs {tuple(xs.shape)}, "
                         f"wq {tuple(wq.shape)}, ws {tuple(ws.shape)} do not fit block "
                         f"{(bo, bi)}")
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return y
    cfg = dict(config or gemm_config(M, N, xq.device, bi))
    if cfg["BLOCK_K"] != bi:
        raise ValueError(f"BLOCK_K={cfg['BLOCK_K']}: must be the scale block width {bi}")
    launch = {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _w8a8_block[grid](xq, xs, wq, ws, y, M, N, K, *xq.stride(), *xs.stride(), *wq.stride(),
                      *ws.stride(), *y.stride(), BO=bo, FP8_DOT=_fp8_dot(xq.device), **cfg,
                      **launch)
    return y


def fp8_block_linear(x: torch.Tensor, qw: QuantizedWeight,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in x's dtype, W = ``qw`` (fp8, [N, K])."""
    K = qw.shape[-1]
    x2 = x.reshape(-1, K)
    xq, xs = quant_act_fp8_triton(x2, qw.fmt.block[1], qw.fmt.fp8_dtype)
    y = w8a8_block_fp8_matmul(xq, xs, qw.data, qw.scale, qw.fmt.block, x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
