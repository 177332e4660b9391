"""Fused MoE in Triton: moe_align, then two grouped GEMMs over expert-homogeneous row blocks.

  gemm1: act[slot]  = silu(x[token] @ w1[e, :N].T) * (x[token] @ w1[e, N:].T)   [S, N]
  gemm2: y[slot]    = w[slot] * (act[slot] @ w2[e].T)                            [S, K] fp32
  sum:   out[m]     = y[m*k + 0] + y[m*k + 1] + ... (fixed order j = 0..k-1)     [M, K]
A block whose expert is -1 (not on this rank) writes zeros; accumulation is fp32, fp32 inputs
use IEEE dots (no TF32). ``QuantizedWeight`` weights (int8, int4 nibbles, fp8 blocks;
``triton_qweights.py``) are dequantised in the tile; fp8 needs ``BLOCK_K`` = the weight's block
width. ``w1``/``w2`` are logical; stored int4 is [E, 2N, K/2] / [E, K, N/2] uint8.
docs/kernels.md, "Fused grouped GEMM (Triton)".
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .tile_configs import get_config, interpreting
from .triton_align import moe_align_triton
from .triton_dot import dot
from .triton_qweights import FMT_IDS, FP8_GRID, load_weight_tile, quant_act_tile
from .weight_quant import QuantizedWeight


@triton.jit
def _block_coords(EM, NOUT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped launch order: GROUP_M row blocks share each column sweep (weight reuse in L2)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(NOUT, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n




@triton.jit
def _moe_gemm1(x_ptr, w1_ptr, act_ptr, sorted_ptr, bexp_ptr, npad_ptr, EM, S, N, K, top_k,
               s_xm, s_xk, s_we, s_wn, s_wk, s_am, s_an, s1_ptr, s_se, s_sa, s_sb,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
               FMT: tl.constexpr, G: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
               MANT: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    pid_m, pid_n = _block_coords(EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    row_ok = slot < S
    token = (slot // top_k).to(tl.int64)  # int64: row * stride can pass 2**31
    slot = slot.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = offs_n < N
    out_ptrs = act_ptr + slot[:, None] * s_am + offs_n[None, :] * s_an
    out_mask = row_ok[:, None] & n_ok[None, :]
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if e == -1:
        zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=act_ptr.dtype.element_ty)
        tl.store(out_ptrs, zeros, mask=out_mask)
        return
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base, s_base = w1_ptr + e * s_we, s1_ptr + e * s_se
    xdt = x_ptr.dtype.element_ty
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = offs_k < K
        a = tl.load(x_ptr + token[:, None] * s_xm + offs_k[None, :] * s_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        if FMT == 3:  # fp8: the activations per token per BK(= BI)-group, as an fp8 GEMM
            a = quant_act_tile(a, MANT, EMIN, FMAX).to(xdt)
        b_mask = k_ok[:, None] & n_ok[None, :]
        bg = load_weight_tile(w_base, s_base, offs_n, offs_k, b_mask, s_wn, s_wk, s_sa, s_sb,
                              FMT, G, BO, BI).to(xdt)  # [BK, BN] gate
        bu = load_weight_tile(w_base, s_base, offs_n + N, offs_k, b_mask, s_wn, s_wk, s_sa,
                              s_sb, FMT, G, BO, BI).to(xdt)  # [BK, BN] up
        acc_g = dot(a, bg, acc_g, IEEE, UPCAST)
        acc_u = dot(a, bu, acc_u, IEEE, UPCAST)
    act = acc_g * tl.sigmoid(acc_g) * acc_u  # silu(gate) * up, fp32
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _moe_gemm2(a_ptr, w2_ptr, y_ptr, tw_ptr, sorted_ptr, bexp_ptr, npad_ptr, EM, S, KOUT, N,
               s_am, s_an, s_we, s_wk, s_wn, s_ym, s_yk, s2_ptr, s_se, s_sa, s_sb,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
               FMT: tl.constexpr, G: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
               MANT: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    pid_m, pid_n = _block_coords(EM, KOUT, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    row_ok = slot < S
    slot = slot.to(tl.int64)
    offs_o = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output (hidden) columns
    o_ok = offs_o < KOUT
    out_ptrs = y_ptr + slot[:, None] * s_ym + offs_o[None, :] * s_yk
    out_mask = row_ok[:, None] & o_ok[None, :]
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if e == -1:
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), mask=out_mask)
        return
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base, s_base = w2_ptr + e * s_we, s2_ptr + e * s_se
    adt = a_ptr.dtype.element_ty
    for k0 in range(0, N, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK] over the intermediate dim N
        k_ok = offs_k < N
        a = tl.load(a_ptr + slot[:, None] * s_am + offs_k[None, :] * s_an,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        if FMT == 3:
            a = quant_act_tile(a, MANT, EMIN, FMAX).to(adt)
        b = load_weight_tile(w_base, s_base, offs_o, offs_k, k_ok[:, None] & o_ok[None, :],
                             s_wk, s_wn, s_sa, s_sb, FMT, G, BO, BI).to(adt)  # [BK, BN]
        acc = dot(a, b, acc, IEEE, UPCAST)
    w = tl.load(tw_ptr + slot, mask=row_ok, other=0.0)  # [BM] router weight of each slot
    tl.store(out_ptrs, acc * w[:, None], mask=out_mask)


@triton.jit
def _moe_sum(y_ptr, out_ptr, M, KOUT, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, :] = sum_j y[m*TOP_K + j, :], j ascending (deterministic)."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < KOUT
    acc = tl.load(y_ptr + (m * TOP_K) * KOUT + offs, mask=ok, other=0.0)
    for j in tl.static_range(1, TOP_K):
        acc += tl.load(y_ptr + (m * TOP_K + j) * KOUT + offs, mask=ok, other=0.0)
    tl.store(out_ptr + m * KOUT + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fused_moe_triton(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     expert_map: Optional[torch.Tensor] = None,
                     config: Optional[dict] = None) -> torch.Tensor:
    """Same contract as ``fused_moe_ref``. ``config`` overrides the tile-config table.
    ``w1``/``w2`` may be ``QuantizedWeight``s: int8, int4 in the ``nibbles`` layout, or fp8
    (then ``BLOCK_K`` is the block width, and the weight's row blocks must hold whole N)."""
    M, k = topk_ids.shape
    E_l, N2, K = w1.shape
    N = N2 // 2
    dev = hidden.device
    out = torch.empty(M, K, dtype=hidden.dtype, device=dev)
    if M == 0:
        return out
    E_g = E_l if expert_map is None else expert_map.numel()
    cfg = config or get_config(E_l, N, K, M, k, hidden.dtype, dev)
    q1, q2 = _quant_args(w1), _quant_args(w2)
    BM, BN, BK, GM = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["GROUP_M"]
    if q1["FMT"] == FMT_IDS["fp8"]:
        BK = q1["BI"]  # one activation group per K tile
    launch = dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    sorted_ids, bexp, npad = moe_align_triton(topk_ids, E_g, BM, expert_map)
    S, EM = M * k, sorted_ids.numel()
    act = torch.empty(S, N, dtype=hidden.dtype, device=dev)  # [S, N]
    y = torch.empty(S, K, dtype=torch.float32, device=dev)  # [S, K] weighted, per slot
    tw = topk_weights.reshape(-1).float().contiguous()  # [S]
    ieee = hidden.dtype == torch.float32
    up = not ieee and interpreting()
    grid1 = (triton.cdiv(EM, BM) * triton.cdiv(N, BN),)
    blocks = dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GM, IEEE=ieee, UPCAST=up)
    d1, d2 = _data(w1), _data(w2)
    _moe_gemm1[grid1](hidden, d1, act, sorted_ids, bexp, npad, EM, S, N, K, k,
                      hidden.stride(0), hidden.stride(1), *d1.stride(), *act.stride(),
                      *q1.pop("scale"), **blocks, **q1, **launch)
    grid2 = (triton.cdiv(EM, BM) * triton.cdiv(K, BN),)
    _moe_gemm2[grid2](act, d2, y, tw, sorted_ids, bexp, npad, EM, S, K, N,
                      *act.stride(), *d2.stride(), *y.stride(), *q2.pop("scale"),
                      **blocks, **q2, **launch)
    SB = min(1024, triton.next_power_of_2(K))
    _moe_sum[(M, triton.cdiv(K, SB))](y, out, M, K, TOP_K=k, BLOCK=SB)
    return out


def _data(w) -> torch.Tensor:
    return w.data if isinstance(w, QuantizedWeight) else w


def _quant_args(w) -> dict:
    """The quantised-weight arguments of a grouped GEMM: the scale pointer and its strides
    (expert, a, b) under ``scale``, and the FMT, G, BO, BI, MANT, EMIN, FMAX constexprs."""
    q = dict(FMT=0, G=1, BO=1, BI=1, MANT=3, EMIN=-6, FMAX=448.0)
    if not isinstance(w, QuantizedWeight):
        return dict(q, scale=(w, 0, 0, 0))  # never read
    f, s = w.fmt, w.scale
    q["FMT"] = FMT_IDS[f.name]
    if f.name == "int8":
        return dict(q, scale=(s, s.stride(0), s.stride(1), 0))
    if f.name == "int4":
        if f.int4_layout != "nibbles":
            raise ValueError("int4 weights in torch's CPU layout: the Triton MoE kernels take "
                             "the 'nibbles' layout (weight_quant.pack_int4)")
        return dict(q, G=f.group_size, scale=(s, s.stride(0), s.stride(1), s.stride(2)))
    q["MANT"], q["EMIN"], q["FMAX"] = FP8_GRID[f.fp8_dtype]
    q["BO"], q["BI"] = f.block
    return dict(q, scale=(s, s.stride(0), s.stride(1), s.stride(2)))
