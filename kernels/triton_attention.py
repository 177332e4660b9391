"""Paged attention in Triton: store K/V into the cache, varlen causal prefill, split-KV decode.

kv_cache [2, NB, BS, Hkv, D] (0 = keys, 1 = values); block_tables [S, max_blocks] int32/int64.
Key tiles of BLOCK_N positions are gathered per position (block id from the table, then
offset), so tiles are independent of the page size: any block_size works. Padding entries of
a block table are never read past seq_len. Softmax is online, in the log2 domain (exp2 with
scale * log2(e)); m, l and acc are fp32; the output is q's dtype. fp32 inputs use IEEE dots (no
TF32). Head dims 1..256 are padded to a power of two BLOCK_D >= 16 with masks. GQA: the query
heads of one kv head share each K/V tile (rows = query tokens x heads of the group).
References: ``attention_ref.py``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .attention_ref import check_attention_args, supported_head_dim
from .entry_points import KernelInputError
from .tile_configs import interpreting
from .triton_dot import dot, dot_flags
from .triton_kv_cache import _fp4, _kv_tile, _quant_args, store_kv

__all__ = ["store_kv", "prefill_attention", "decode_attention", "choose_num_splits",
           "check_attention_args", "supported_head_dim"]
LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(q_ptr, o_ptr, cache_ptr, qsl_ptr, sl_ptr, bt_ptr, sc_ptr, scale_log2, D,
                    s_qt, s_qh, s_ot, s_oh, s_c2, s_cb, s_cs, s_ch, s_bt, s_bn,
                    G: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
                    FP4: tl.constexpr):
    """Program (seq, kv head, query tile): BLOCK_Q tokens x G heads = BLOCK_M rows.
    QUANT: a float8 cache, each K/V tile times its float32 scale in registers."""
    s = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    q0 = tl.program_id(2) * BLOCK_Q  # first query of the tile, within the sequence
    start = tl.load(qsl_ptr + s).to(tl.int64)
    qlen = (tl.load(qsl_ptr + s + 1) - start).to(tl.int32)
    if q0 >= qlen:
        return
    seq_len = tl.load(sl_ptr + s).to(tl.int32)
    ctx = seq_len - qlen  # cached tokens before this chunk
    r = tl.arange(0, BLOCK_M)
    qi = q0 + r // G  # [BM] query index within the sequence
    head = kvh * G + r % G  # [BM] query head
    row_ok = (r < BLOCK_Q * G) & (qi < qlen)
    qpos = ctx + qi  # [BM] absolute position
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    tok = (start + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)  # one past the last key any row sees
    bt_row = bt_ptr + s.to(tl.int64) * s_bt
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BN] key positions
        ok = pos < kv_end
        blk = tl.load(bt_row + (pos // BS) * s_bn, mask=ok, other=0).to(tl.int64)  # [BN]
        base = cache_ptr + blk * s_cb + (pos % BS).to(tl.int64) * s_cs + kvh * s_ch  # [BN]
        kv_mask = ok[:, None] & d_ok[None, :]
        k, v = _kv_tile(base, d, kv_mask, D, s_c2, sc_ptr, FP4, QUANT)  # [BN, BD] each
        k, v = k.to(q.dtype), v.to(q.dtype)
        qk = dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE, UPCAST)
        see = ok[None, :] & (pos[None, :] <= qpos[:, None])  # [BM, BN] causal
        qk = tl.where(see, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])  # [BM, BN]
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST)
        m = m_new
    acc = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                      scale: float, out: Optional[torch.Tensor] = None,
                      scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal varlen attention of T new tokens over the paged cache -> out [T, Hq, D], q's dtype.

    q [T, Hq, D]; query_start_loc [S+1]; seq_lens [S] = cached + new tokens; block_tables
    [S, max_blocks]. Query i of sequence s sits at seq_lens[s] - qlen + i and sees keys up to it;
    the new tokens' K/V must be in the cache already (``store_kv``). ``max_query_len`` (host int,
    >= every qlen) sizes the grid: no device->host sync. Rows of out past query_start_loc[-1]
    are left as they were (zeros when out is None). A float8 cache: ``scales`` float32 [2].
    """
    check_attention_args(q, kv_cache, block_tables, seq_lens, query_start_loc, out)
    sc, quant = _quant_args(kv_cache, scales, q)
    T, Hq, D = q.shape
    _, NB, BS, Hkv, _ = kv_cache.shape
    S, G = seq_lens.shape[0], Hq // Hkv
    out = torch.zeros_like(q) if out is None else out
    if T == 0 or S == 0 or max_query_len <= 0:
        return out
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_M = max(16 if interpreting() else 64, triton.next_power_of_2(G))
    BLOCK_Q = BLOCK_M // G
    BLOCK_N = 32 if interpreting() or BLOCK_D > 128 else 64
    grid = (S, Hkv, triton.cdiv(max_query_len, BLOCK_Q))
    _prefill_kernel[grid](q, out, kv_cache, query_start_loc, seq_lens, block_tables, sc,
                          scale * LOG2E, D, q.stride(0), q.stride(1), out.stride(0),
                          out.stride(1), *kv_cache.stride()[:4], *block_tables.stride(),
                          G=G, BS=BS, BLOCK_M=BLOCK_M, BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N,
                          BLOCK_D=BLOCK_D, **dot_flags(q.dtype), QUANT=quant, **_fp4(kv_cache),
                          num_warps=4 if BLOCK_D <= 64 else 8,
                          num_stages=2)
    return out


@triton.jit
def _decode_split_kernel(q_ptr, cache_ptr, sl_ptr, bt_ptr, sc_ptr, mo_ptr, mlse_ptr, scale_log2,
                         D,
                         s_qs, s_qh, s_c2, s_cb, s_cs, s_ch, s_bt, s_bn,
                         G: tl.constexpr, BS: tl.constexpr, NS: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
                         FP4: tl.constexpr):
    """Program (seq, kv head, split): the G query heads over keys [lo, hi) of one split ->
    mid_o [S, Hq, NS, D] = acc / l (fp32) and mid_lse [S, Hq, NS] = m + log2(l) (-inf: empty)."""
    s = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + s).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seq_len, NS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    head = kvh * G + g  # [BG]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + s.to(tl.int64) * s_qs + head[:, None] * s_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BG, BD]
    m = tl.full([BLOCK_G], -1e30, tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * s_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BN]
        ok = pos < hi
        blk = tl.load(bt_row + (pos // BS) * s_bn, mask=ok, other=0).to(tl.int64)  # [BN]
        base = cache_ptr + blk * s_cb + (pos % BS).to(tl.int64) * s_cs + kvh * s_ch  # [BN]
        kv_mask = ok[:, None] & d_ok[None, :]
        k, v = _kv_tile(base, d, kv_mask, D, s_c2, sc_ptr, FP4, QUANT)  # [BN, BD] each
        k, v = k.to(q.dtype), v.to(q.dtype)
        qk = dot(q, tl.trans(k), tl.zeros([BLOCK_G, BLOCK_N], tl.float32), IEEE, UPCAST)
        qk = tl.where(ok[None, :], qk * scale_log2, float("-inf"))  # [BG, BN]
        m_new = tl.maximum(m, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST)
        m = m_new
    row = (s.to(tl.int64) * G * tl.num_programs(1) + head) * NS + split  # [BG] in [S*Hq*NS]
    l_safe = tl.where(l > 0, l, 1.0)
    tl.store(mo_ptr + row[:, None] * D + d[None, :], acc / l_safe[:, None],
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(mlse_ptr + row, tl.where(l > 0, m + tl.log2(l_safe), float("-inf")), mask=g_ok)


@triton.jit
def _decode_merge_kernel(mo_ptr, mlse_ptr, o_ptr, D, s_os, s_oh,
                         NS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (seq, head): out = sum_j 2^lse_j o_j / sum_j 2^lse_j (zeros if every split empty)."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (s * tl.num_programs(1) + h) * NS + j  # [BS]
    lse = tl.load(mlse_ptr + row, mask=j < NS, other=float("-inf"))  # [BS]
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))  # [BS]
    o = tl.load(mo_ptr + row[:, None] * D + d[None, :], mask=(j < NS)[:, None] & (d < D)[None, :],
                other=0.0)  # [BS, BD]
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)  # [BD]
    tl.store(o_ptr + s * s_os + h * s_oh + d, res.to(o_ptr.dtype.element_ty), mask=d < D)


def _sm_count(device: torch.device) -> int:
    return _cuda_sm_count(device.index) if device.type == "cuda" else 2


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index) -> int:  # asked once per device, not per layer and step
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(S: int, Hkv: int, max_blocks: int, block_size: int,
                      device: torch.device) -> int:
    """Splits per (seq, kv head) from host info only (never seq_lens values, so the grid is
    CUDA-graph safe): enough programs for ~2 waves of SMs, >= 256 keys per split, <= 32."""
    by_len = triton.cdiv(max_blocks * block_size, 256)
    by_grid = triton.cdiv(2 * _sm_count(device), max(1, S * Hkv))
    return max(1, min(by_len, by_grid, 32))


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, num_splits: Optional[int] = None,
                     out: Optional[torch.Tensor] = None,
                     scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One query per sequence, at position seq_lens[s] - 1: q [S, Hq, D] -> out [S, Hq, D].

    Split-KV: program (seq, kv head, split) writes a partial softmax of its key range to fp32
    scratch [S, Hq, num_splits, D] (+ log2-sum-exp [S, Hq, num_splits]); a merge kernel
    combines the splits. seq_lens[s] == 0 gives zeros. num_splits=None: ``choose_num_splits``.
    """
    check_attention_args(q, kv_cache, block_tables, seq_lens, None, out, decode=True)
    sc, quant = _quant_args(kv_cache, scales, q)
    S, Hq, D = q.shape
    _, NB, BS, Hkv, _ = kv_cache.shape
    G = Hq // Hkv
    out = torch.empty_like(q) if out is None else out
    if S == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(S, Hkv, block_tables.shape[1], BS, q.device)
    if num_splits < 1:
        raise KernelInputError(f"num_splits: expected >= 1, got {num_splits}")
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N = 32 if interpreting() or BLOCK_D > 128 else 64
    mid_o = torch.empty(S, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(S, Hq, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(S, Hkv, num_splits)](
        q, kv_cache, seq_lens, block_tables, sc, mid_o, mid_lse, scale * LOG2E, D,
        q.stride(0), q.stride(1), *kv_cache.stride()[:4], *block_tables.stride(),
        G=G, BS=BS, NS=num_splits, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D, **dot_flags(q.dtype), QUANT=quant, **_fp4(kv_cache), num_warps=4,
        num_stages=2)
    _decode_merge_kernel[(S, Hq)](mid_o, mid_lse, out, D, out.stride(0), out.stride(1),
                                  NS=num_splits,
                                  BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
                                  BLOCK_D=BLOCK_D, num_warps=4)
    return out
