"""Absorbed MLA decode in Triton over a paged latent cache (the latent store, ``store_latent``,
is in ``triton_mla_store.py``, importable from here too).

cache [NB, BS, R + P]: per token c_kv [R] then k_pe [P], shared by every head; block_tables
[S, max_blocks] int32/int64. score = (q_latent . c_kv + q_pe . k_pe) * scale, out =
softmax(score) @ c_kv -> [S, H, R]. Split-KV: program (seq, head block, split) serves BLOCK_H
heads (the M dimension of ``tl.dot``) with each tile of BLOCK_N latent rows; online softmax in
the log2 domain with fp32 m/l/acc, then a merge pass. R and P are padded to powers of two
>= 16 and masked; the grid depends only on shapes (CUDA-graph safe). References: ``mla_ref.py``.
docs/kernels.md, "MLA (latent) attention".
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .entry_points import KernelInputError
from .kv_formats import fp4_split_fits
from . import kv_quant
from .mla_ref import check_mla_args, supported_mla_dims
from .tile_configs import interpreting
from .triton_attention import choose_num_splits
from .triton_fp4 import _fp4_tile
from .triton_kv_scales import _row_scale_fp4, _row_scale_fp8
from .triton_mla_store import store_latent
from .triton_dot import dot, dot_flags

__all__ = ["store_latent", "mla_decode", "choose_mla_num_splits", "check_mla_args",
           "supported_mla_dims"]

LOG2E = 1.4426950408889634
BLOCK_H = 16  # heads per program: the M dimension of the dots (tl.dot needs >= 16)


@triton.jit
def _mla_split_kernel(ql_ptr, qp_ptr, cache_ptr, sl_ptr, bt_ptr, sc_ptr, mo_ptr, mlse_ptr,
                      scale_log2, H, R, P, s_ls, s_lh, s_ps, s_ph, s_cb, s_cs, s_bt, s_bn,
                      BS: tl.constexpr, NS: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                      IEEE: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
                      FP4: tl.constexpr, WR, ROWS: tl.constexpr = False):
    """Program (seq, head block, split): BLOCK_H heads over rows [lo, hi) of one split ->
    mid_o [S, H, NS, R] = acc / l (fp32), mid_lse [S, H, NS] = m + log2(l) (-inf: empty).
    QUANT: a float8 cache, c_kv times sc_ptr[0] and k_pe times sc_ptr[1] in registers; FP4: an
    fp4_e2m1 cache (c_kv's codes and block scales at 0, k_pe's at byte WR), unpacked in
    registers. ROWS (token_head): each part times its own inline scale; k_pe's part at WR."""
    s = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + s).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seq_len, NS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    head = (hb * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # [BH]
    h_ok = head < H
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    p = tl.arange(0, BLOCK_P)
    p_ok = p < P
    q_lat = tl.load(ql_ptr + s * s_ls + head[:, None] * s_lh + r[None, :],
                    mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # [BH, BR]
    q_pe = tl.load(qp_ptr + s * s_ps + head[:, None] * s_ph + p[None, :],
                   mask=h_ok[:, None] & p_ok[None, :], other=0.0)  # [BH, BP]
    m = tl.full([BLOCK_H], -1e30, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    bt_row = bt_ptr + s * s_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BN]
        ok = pos < hi
        blk = tl.load(bt_row + (pos // BS) * s_bn, mask=ok, other=0).to(tl.int64)  # [BN]
        base = cache_ptr + blk * s_cb + (pos % BS).to(tl.int64) * s_cs  # [BN]
        mr = ok[:, None] & r_ok[None, :]
        mp = ok[:, None] & p_ok[None, :]
        if FP4:
            if ROWS:
                sr = _row_scale_fp4(base, r, mr, R)
                sp = _row_scale_fp4(base + WR, p, mp, P)
            else:
                sr = tl.load(sc_ptr)
                sp = tl.load(sc_ptr + 1)
            c_kv = _fp4_tile(base, r, mr, R, sr).to(q_lat.dtype)
            k_pe = _fp4_tile(base + WR, p, mp, P, sp).to(q_lat.dtype)
        else:
            c_kv = tl.load(base[:, None] + r[None, :], mask=mr,
                           other=0.0)  # [BN, BR]: keys and values at once
            k_pe = tl.load(base[:, None] + WR + p[None, :], mask=mp, other=0.0)  # [BN, BP]
        if ROWS and not FP4:
            c_kv = (c_kv.to(tl.float32) * _row_scale_fp8(base, r, mr, R)).to(q_lat.dtype)
            k_pe = (k_pe.to(tl.float32) * _row_scale_fp8(base + WR, p, mp, P)).to(q_lat.dtype)
        elif QUANT and not FP4:
            c_kv = (c_kv.to(tl.float32) * tl.load(sc_ptr)).to(q_lat.dtype)
            k_pe = (k_pe.to(tl.float32) * tl.load(sc_ptr + 1)).to(q_lat.dtype)
        qk = dot(q_lat, tl.trans(c_kv), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), IEEE, UPCAST)
        qk = dot(q_pe, tl.trans(k_pe), qk, IEEE, UPCAST)
        qk = tl.where(ok[None, :], qk * scale_log2, float("-inf"))  # [BH, BN]
        m_new = tl.maximum(m, tl.max(qk, 1))
        pr = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(pr, 1)
        acc = dot(pr.to(c_kv.dtype), c_kv, acc * alpha[:, None], IEEE, UPCAST)
        m = m_new
    row = (s * H + head) * NS + split  # [BH] in [S*H*NS]
    l_safe = tl.where(l > 0, l, 1.0)
    tl.store(mo_ptr + row[:, None] * R + r[None, :], acc / l_safe[:, None],
             mask=h_ok[:, None] & r_ok[None, :])
    tl.store(mlse_ptr + row, tl.where(l > 0, m + tl.log2(l_safe), float("-inf")), mask=h_ok)


@triton.jit
def _mla_merge_kernel(mo_ptr, mlse_ptr, o_ptr, H, R, s_os, s_oh,
                      NS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (seq, head): out = sum_j 2^lse_j o_j / sum_j 2^lse_j (zeros if every split is
    empty). The splits are summed one at a time so a 512-wide row stays small in registers."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row0 = (s * H + h) * NS
    j = tl.arange(0, BLOCK_S)
    lse = tl.load(mlse_ptr + row0 + j, mask=j < NS, other=float("-inf"))  # [BLOCK_S]
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    den = tl.sum(tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top)), 0)
    res = tl.zeros([BLOCK_R], tl.float32)
    for k in range(NS):
        lse_k = tl.load(mlse_ptr + row0 + k)
        w = tl.where(lse_k == float("-inf"), 0.0, tl.exp2(lse_k - top))
        res += w * tl.load(mo_ptr + (row0 + k) * R + r, mask=r_ok, other=0.0)
    res = res / tl.where(den > 0, den, 1.0)
    tl.store(o_ptr + s * s_os + h * s_oh + r, res.to(o_ptr.dtype.element_ty), mask=r_ok)


def choose_mla_num_splits(S: int, H: int, max_blocks: int, block_size: int,
                          device: torch.device) -> int:
    """Splits per (seq, head block) from host info only (``choose_num_splits`` with the head
    blocks of BLOCK_H heads in the place of kv heads): never reads seq_lens values."""
    return choose_num_splits(S, triton.cdiv(H, BLOCK_H), max_blocks, block_size, device)


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
               seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
               kv_lora_rank: int, num_splits: Optional[int] = None,
               out: Optional[torch.Tensor] = None,
               scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Absorbed MLA decode, one query per sequence over latent rows [0, seq_lens[s]).

    q_latent [S, H, R] (q_nope @ W_UK per head), q_pe [S, H, P] (rotated), cache [NB, BS, R + P],
    R = kv_lora_rank -> out [S, H, R] in q's dtype (apply W_UV afterwards). seq_lens[s] == 0
    gives zeros. Program (seq, head block, split) writes a partial softmax to fp32 scratch
    [S, H, num_splits, R]; a merge kernel combines the splits. num_splits=None:
    ``choose_mla_num_splits`` (host info only, so the call can be captured in a CUDA graph).
    A float8 or fp4_e2m1 (uint8) cache (kernels/kv_quant.py): ``scales`` float32 [2] (c_kv,
    k_pe); fp4 rows are R/2 + R/16 bytes of c_kv then P/2 + P/16 of k_pe (R, P multiples of 16).
    """
    check_mla_args(q_latent, q_pe, cache, kv_lora_rank, block_tables, seq_lens, out)
    fp4 = cache.dtype == torch.uint8
    quant = fp4 or cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if quant and (scales is None or scales.dtype != torch.float32 or scales.numel() < 2
                  or scales.device != cache.device):
        raise KernelInputError(f"scales: a quantised cache needs float32 [2] scales (c_kv, k_pe) "
                               f"on {cache.device}")
    S, H, R = q_latent.shape
    NB, BS, W = cache.shape
    P = q_pe.shape[-1]
    fmt, g = kv_quant.format_of(cache), kv_quant.granularity_of(cache)
    rows = quant and g == "token_head"
    if fp4 and not fp4_split_fits(R, P, W, g):
        want = W if R % 16 or P % 16 else kv_quant.stored_dim(fmt, R, g) + kv_quant.stored_dim(fmt, P, g)
        raise KernelInputError(f"cache: fp4_e2m1 rows of R={R} + P={P} (multiples of 16) are "
                               f"{want} bytes, got {W}")
    out = torch.empty_like(q_latent) if out is None else out
    if S == 0 or H == 0:
        return out
    if num_splits is None:
        num_splits = choose_mla_num_splits(S, H, block_tables.shape[1], BS, q_latent.device)
    if num_splits < 1:
        raise KernelInputError(f"num_splits: expected >= 1, got {num_splits}")
    BLOCK_R = max(16, triton.next_power_of_2(R))
    BLOCK_P = max(16, triton.next_power_of_2(P))
    # SGLang's grouped MLA decode tile: 32 rows of 576 bf16 per step; fp32 rows of 512+ are
    # twice the bytes, so half the rows keep two pipeline stages in shared memory
    big = not interpreting() and q_latent.element_size() == 4 and BLOCK_R >= 256
    BLOCK_N = 16 if big else 32
    mid_o = torch.empty(S, H, num_splits, R, dtype=torch.float32, device=q_latent.device)
    mid_lse = torch.empty(S, H, num_splits, dtype=torch.float32, device=q_latent.device)
    _mla_split_kernel[(S, triton.cdiv(H, BLOCK_H), num_splits)](
        q_latent, q_pe, cache, seq_lens, block_tables, scales if quant else seq_lens, mid_o,
        mid_lse, scale * LOG2E, H, R, P,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), *block_tables.stride(),
        BS=BS, NS=num_splits, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
        BLOCK_P=BLOCK_P, **dot_flags(q_latent.dtype), QUANT=quant, FP4=fp4,
        WR=kv_quant.stored_dim(fmt, R, g) if quant else R, ROWS=rows, num_warps=4,
        num_stages=2)
    _mla_merge_kernel[(S, H)](mid_o, mid_lse, out, H, R, out.stride(0), out.stride(1),
                              NS=num_splits, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
                              BLOCK_R=BLOCK_R, num_warps=4)
    return out
