"""The paged KV cache in Triton: writing new keys/values through a slot mapping (quantised to
the cache's format: model dtype, float8 with a per-layer scale, or packed fp4 with block scales)
and reading a tile of cache rows back, dequantised in registers (``_kv_tile``, used by the
attention kernels in ``triton_attention.py`` and ``triton_mla.py``). Formats: ``kv_quant.py``;
the fp4 row quantiser and tile reader: ``triton_fp4.py``.

``token_head`` scales (``QUANT == 2``): each stored row ends with its own scale (fp8: bf16 bytes
after the D elements; fp4: an E8M0 byte after the block scales), computed by the store kernel
from the row (bit-identical to ``kv_quant.quant_rows``; fp8 rows by
``triton_kv_scales._quant_fp8_part``, as the MLA store's) and read back per row in ``_kv_tile``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import kv_quant
from .attention_ref import FP8_CACHE_DTYPES, check_attention_args, token_head_cache
from .entry_points import KernelInputError
from .kv_formats import fp8_grid
from .triton_fp4 import NO_FMA, _fp4_tile, _quant_fp4_row, fp4_blocks_padded
from .triton_kv_scales import _quant_fp8_part, _round_fp8, _row_scale_fp4, _row_scale_fp8


@triton.jit
def _store_kv_rows_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, sc_ptr, D, s_kt, s_kh, s_vt, s_vh,
                          s_c2, s_cb, s_cs, s_ch, FMAX, BS: tl.constexpr, FP4: tl.constexpr,
                          NBP: tl.constexpr, ROWSCALE: tl.constexpr, BLOCK_D: tl.constexpr,
                          MANT: tl.constexpr, EMIN: tl.constexpr):
    """Program (token, KV head): k/v[t, h] [D] -> one stored row each at cache[0/1, slot // BS,
    slot % BS, h] (slot -1 skips). FP4: fp4_e2m1 rows (``_quant_fp4_row``; scales sc_ptr[0]
    keys, [1] values, or ROWSCALE: each row its own). Else token_head float8: D values then the
    row's bf16(amax / FMAX) scale bytes (``_quant_fp8_part``, as the MLA store's parts)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    dst = cache_ptr + (slot // BS) * s_cb + (slot % BS) * s_cs + h * s_ch
    k_row, v_row = k_ptr + t * s_kt + h * s_kh, v_ptr + t * s_vt + h * s_vh
    if FP4:
        if ROWSCALE:  # the rows' own scales: no layer scale to read
            gk = 0.0
            gv = 0.0
        else:
            gk = tl.load(sc_ptr)
            gv = tl.load(sc_ptr + 1)
        _quant_fp4_row(k_row, dst, D, gk, NBP, ROWSCALE)
        _quant_fp4_row(v_row, dst + s_c2, D, gv, NBP, ROWSCALE)
    else:
        _quant_fp8_part(k_row, dst, D, FMAX, BLOCK_D, MANT, EMIN)
        _quant_fp8_part(v_row, dst + s_c2, D, FMAX, BLOCK_D, MANT, EMIN)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, sc_ptr, H, D, s_kt, s_kh, s_vt, s_vh,
                     s_c2, s_cb, s_cs, s_ch, FMAX,
                     BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     QUANT: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """One program per token: k/v[t] [H, D] -> cache[0/1, slot // BS, slot % BS]
    (QUANT: a float8 cache, x / scale saturated to +-FMAX; scales sc_ptr[0] keys, [1] values;
    token_head rows: ``_store_kv_rows_kernel``)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]  # [BH, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BD]
    mask = (h < H) & (d < D)
    dst = cache_ptr + (slot // BS) * s_cb + (slot % BS) * s_cs + h * s_ch + d  # [BH, BD]
    k = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=mask, other=0.0)
    if QUANT:
        ks = tl.load(sc_ptr)
        vs = tl.load(sc_ptr + 1)
        k_inv = tl.where(ks > 0, tl.math.div_rn(1.0, tl.where(ks > 0, ks, 1.0)), 0.0)
        v_inv = tl.where(vs > 0, tl.math.div_rn(1.0, tl.where(vs > 0, vs, 1.0)), 0.0)
        k = _round_fp8(k.to(tl.float32) * k_inv, FMAX, MANT, EMIN)
        v = _round_fp8(v.to(tl.float32) * v_inv, FMAX, MANT, EMIN)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + s_c2, v.to(cache_ptr.dtype.element_ty), mask=mask)


def _quant_args(kv_cache: torch.Tensor, scales: Optional[torch.Tensor], like: torch.Tensor):
    """(scales tensor, QUANT) for a float8 or fp4 (uint8) cache (scales: float32 [2], keys then
    values); QUANT == 2: token_head rows (``like``'s head dim D: no per-layer scales read)."""
    if kv_cache.dtype not in FP8_CACHE_DTYPES + (torch.uint8,):
        return like, False
    if token_head_cache(kv_cache, like.shape[-1] if like.dtype != torch.uint8 else None):
        return like, 2
    if (scales is None or scales.dtype != torch.float32 or scales.numel() < 2
            or scales.device != kv_cache.device):
        raise KernelInputError("scales: a float8 kv_cache needs float32 [2] scales (keys, "
                               f"values) on {kv_cache.device}")
    return scales, True


def _fp4(kv_cache: torch.Tensor) -> dict:
    return dict(FP4=kv_cache.dtype == torch.uint8)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, scales: Optional[torch.Tensor] = None) -> None:
    """k, v [T, Hkv, D] -> kv_cache [2, NB, BS, Hkv, D] at slot_mapping [T] (int; -1 skips).
    A float8 cache stores saturate(x / scales[0 or 1]) (``kernels/kv_quant.py``); an fp4_e2m1
    (uint8) cache [2, NB, BS, Hkv, D/2 + D/16] quantises k, v [T, Hkv, D] (float) in the kernel
    with ``scales`` (bit-identical to ``kv_quant.quant_fp4``: least-squared-error block scales),
    or copies uint8 rows already packed by it."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise KernelInputError(f"kv_cache: expected [2, num_blocks, block_size, Hkv, D], "
                               f"got {tuple(kv_cache.shape)}")
    _, NB, BS, Hkv, D = kv_cache.shape
    T = k.shape[0] if k.dim() else 0
    if kv_cache.dtype == torch.uint8 and k.dtype != torch.uint8:  # fp4: quantised here
        rows = token_head_cache(kv_cache)
        Dv = kv_quant.value_dim("fp4_e2m1", D, "token_head" if rows else "tensor")
        for name, t in (("k", k), ("v", v)):
            if (tuple(t.shape) != (T, Hkv, Dv) or not t.is_floating_point()
                    or t.device != kv_cache.device or (t.numel() and t.stride(-1) != 1)):
                raise KernelInputError(
                    f"{name}: an fp4_e2m1 cache of rows {D} takes float [{T}, {Hkv}, {Dv}] on "
                    f"{kv_cache.device} (or packed uint8 rows), got {tuple(t.shape)} {t.dtype}")
        sc, _ = _quant_args(kv_cache, scales, k)
        if (slot_mapping.shape != (T,) or slot_mapping.dtype not in (torch.int32, torch.int64)
                or slot_mapping.device != k.device):
            raise KernelInputError(f"slot_mapping: expected [{T}] int32/int64 on {k.device}")
        if T:
            _store_kv_rows_kernel[(T, Hkv)](k, v, kv_cache, slot_mapping, sc, Dv, k.stride(0),
                                            k.stride(1), v.stride(0), v.stride(1),
                                            *kv_cache.stride()[:4], 0.0, BS=BS, FP4=True,
                                            NBP=fp4_blocks_padded(Dv), ROWSCALE=rows, BLOCK_D=16,
                                            MANT=0, EMIN=0, **NO_FMA)
        return
    if kv_cache.dtype == torch.uint8:  # fp4_e2m1: rows already packed by kv_quant.quant_fp4
        for name, t in (("k", k), ("v", v)):
            if (tuple(t.shape) != (T, Hkv, D) or t.dtype != torch.uint8
                    or t.device != kv_cache.device or t.stride(-1) != 1):
                raise KernelInputError(
                    f"{name}: an fp4_e2m1 cache takes rows packed by kv_quant.quant_fp4, uint8 "
                    f"[{T}, {Hkv}, {D}] on {kv_cache.device}, got {tuple(t.shape)} {t.dtype}")
        if T:  # a byte copy through the slot mapping (-1 skips: CUDA-graph padding rows)
            _store_kv_kernel[(T,)](k, v, kv_cache, slot_mapping, k, Hkv, D, k.stride(0),
                                   k.stride(1), v.stride(0), v.stride(1),
                                   *kv_cache.stride()[:4], 0.0, BS=BS,
                                   BLOCK_H=max(2, triton.next_power_of_2(Hkv)),
                                   BLOCK_D=triton.next_power_of_2(D), QUANT=False, MANT=3,
                                   EMIN=-6)
        return
    if kv_cache.dtype in FP8_CACHE_DTYPES and token_head_cache(kv_cache, k.shape[-1]):
        D -= 2  # token_head: D values, then the row's bf16 scale
    want = ((T, Hkv, D), k.dtype if kv_cache.dtype in FP8_CACHE_DTYPES else kv_cache.dtype,
            kv_cache.device)
    for name, t in (("k", k), ("v", v)):
        if (tuple(t.shape), t.dtype, t.device) != want:
            raise KernelInputError(f"{name}: expected [{T}, {Hkv}, {D}] {want[1]} on {want[2]}, "
                                   f"got {tuple(t.shape)} {t.dtype} on {t.device}")
        if t.stride(-1) != 1:
            raise KernelInputError(f"{name}: head_dim must be contiguous (stride 1)")
    check_attention_args(k, kv_cache)  # dtype, head_dim, layout
    if (slot_mapping.shape != (T,) or slot_mapping.dtype not in (torch.int32, torch.int64)
            or slot_mapping.device != k.device):
        raise KernelInputError(f"slot_mapping: expected [{T}] int32/int64 on {k.device}, got "
                               f"{tuple(slot_mapping.shape)} {slot_mapping.dtype} on "
                               f"{slot_mapping.device}")
    sc, quant = _quant_args(kv_cache, scales, k)
    if T == 0:
        return
    fmax, mant, emin = fp8_grid(kv_cache.dtype)
    if quant == 2:  # token_head: each (token, head) row its own scale
        _store_kv_rows_kernel[(T, Hkv)](k, v, kv_cache, slot_mapping, sc, D, k.stride(0),
                                        k.stride(1), v.stride(0), v.stride(1),
                                        *kv_cache.stride()[:4], fmax, BS=BS, FP4=False, NBP=1,
                                        ROWSCALE=True, BLOCK_D=max(16, triton.next_power_of_2(D)),
                                        MANT=mant, EMIN=emin)
        return
    _store_kv_kernel[(T,)](k, v, kv_cache, slot_mapping, sc, Hkv, D, k.stride(0), k.stride(1),
                           v.stride(0), v.stride(1), *kv_cache.stride()[:4], fmax, BS=BS,
                           BLOCK_H=max(2, triton.next_power_of_2(Hkv)),
                           BLOCK_D=triton.next_power_of_2(D), QUANT=quant, MANT=mant,
                           EMIN=emin)


@triton.jit
def _kv_tile(base, d, kv_mask, D, s_c2, sc_ptr, FP4: tl.constexpr, QUANT: tl.constexpr):
    """Keys and values [BN, BD] of the cache rows at ``base`` [BN] (values ``s_c2`` further),
    dequantised in registers: fp4_e2m1 codes and block scales unpacked, float8 times the
    layer's scale, or (QUANT == 2, token_head) each row's own inline scale (fp32 out); a
    model-dtype cache as it is."""
    if FP4:
        if QUANT == 2:
            k = _fp4_tile(base, d, kv_mask, D, _row_scale_fp4(base, d, kv_mask, D))
            v = _fp4_tile(base + s_c2, d, kv_mask, D,
                          _row_scale_fp4(base + s_c2, d, kv_mask, D))
        else:
            k = _fp4_tile(base, d, kv_mask, D, tl.load(sc_ptr))
            v = _fp4_tile(base + s_c2, d, kv_mask, D, tl.load(sc_ptr + 1))
    else:
        k = tl.load(base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(base[:, None] + s_c2 + d[None, :], mask=kv_mask, other=0.0)
        if QUANT == 2:
            k = k.to(tl.float32) * _row_scale_fp8(base, d, kv_mask, D)
            v = v.to(tl.float32) * _row_scale_fp8(base + s_c2, d, kv_mask, D)
        elif QUANT:
            k = k.to(tl.float32) * tl.load(sc_ptr)
            v = v.to(tl.float32) * tl.load(sc_ptr + 1)
    return k, v
