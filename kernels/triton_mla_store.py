"""The MLA latent store in Triton: latent rows [T, R + P] (c_kv then k_pe) written into a paged
latent cache [NB, BS, W] through a slot mapping, as they are (model dtype) or quantised in the
kernel (float8, or fp4_e2m1 with least-squared-error block scales, ``triton_fp4.py``), each
part with its own scale: per layer (``tensor``) or inline per row (``token_head``). Bit-identical
to the torch store (``models/mla_attention.store_latent_torch``, ``kernels/kv_quant.py``).
The decode kernel is in ``triton_mla.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import kv_quant
from .entry_points import KernelInputError
from .kv_formats import fp4_split_fits, fp8_grid
from .mla_ref import check_store_latent_args, latent_value_width
from .triton_fp4 import NO_FMA, _quant_fp4_row, fp4_blocks_padded
from .triton_kv_scales import _quant_fp8_part, _round_fp8


@triton.jit
def _store_latent_kernel(x_ptr, cache_ptr, slot_ptr, W, s_xt, s_cb, s_cs,
                         BS: tl.constexpr, BLOCK_W: tl.constexpr):
    """One program per token: latent[t] [W] -> cache[slot // BS, slot % BS]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    w = tl.arange(0, BLOCK_W)
    mask = w < W
    tl.store(cache_ptr + (slot // BS) * s_cb + (slot % BS) * s_cs + w,
             tl.load(x_ptr + t * s_xt + w, mask=mask), mask=mask)


@triton.jit
def _store_latent_q_kernel(x_ptr, cache_ptr, slot_ptr, sc_ptr, R, P, WR, s_xt, s_cb, s_cs, FMAX,
                           BS: tl.constexpr, FP4: tl.constexpr, BLOCK_W: tl.constexpr,
                           NBR: tl.constexpr, NBP: tl.constexpr, MANT: tl.constexpr,
                           EMIN: tl.constexpr, ROWS: tl.constexpr = False,
                           BLOCK_R: tl.constexpr = 16, BLOCK_P: tl.constexpr = 16):
    """One program per token: latent[t] [R + P] -> a quantised row (kernels/kv_quant.py), c_kv
    with scale sc_ptr[0], k_pe with sc_ptr[1]: float8 (saturate(x / scale)) or fp4_e2m1 (c_kv's
    R/2 + R/16 bytes at 0, k_pe's at WR). ROWS (token_head): each part its own inline scale,
    k_pe's part starting at WR."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    src = x_ptr + t * s_xt
    dst = cache_ptr + (slot // BS) * s_cb + (slot % BS) * s_cs
    if ROWS and FP4:
        _quant_fp4_row(src, dst, R, 0.0, NBR, True)
        _quant_fp4_row(src + R, dst + WR, P, 0.0, NBP, True)
    elif ROWS:
        _quant_fp8_part(src, dst, R, FMAX, BLOCK_R, MANT, EMIN)
        _quant_fp8_part(src + R, dst + WR, P, FMAX, BLOCK_P, MANT, EMIN)
    elif FP4:
        _quant_fp4_row(src, dst, R, tl.load(sc_ptr), NBR)
        _quant_fp4_row(src + R, dst + WR, P, tl.load(sc_ptr + 1), NBP)
    else:
        w = tl.arange(0, BLOCK_W)
        mask = w < R + P
        sc = tl.where(w < R, tl.load(sc_ptr), tl.load(sc_ptr + 1))
        inv = tl.where(sc > 0, tl.math.div_rn(1.0, tl.where(sc > 0, sc, 1.0)), 0.0)
        x = tl.load(src + w, mask=mask, other=0.0).to(tl.float32)
        y = _round_fp8(x * inv, FMAX, MANT, EMIN)
        tl.store(dst + w, y.to(cache_ptr.dtype.element_ty), mask=mask)


def _store_latent_quantised(latent, cache, slot_mapping, scales, R: int) -> None:
    fp4 = cache.dtype == torch.uint8
    W = cache.shape[-1]
    g = kv_quant.granularity_of(cache)
    fmt = kv_quant.format_of(cache)
    RP = latent_value_width(cache)
    if R is None or not 0 < R < RP or (fp4 and not fp4_split_fits(R, RP - R, W, g)):
        raise KernelInputError(f"kv_lora_rank: R={R} does not split a {cache.dtype} row of {W}")
    if (latent.dim() != 2 or latent.shape[1] != RP or not latent.is_floating_point()
            or latent.device != cache.device or (latent.numel() and latent.stride(-1) != 1)):
        raise KernelInputError(f"latent: a quantised cache takes float [T, {RP}] on "
                               f"{cache.device}, got {tuple(latent.shape)} {latent.dtype}")
    if (scales is None or scales.dtype != torch.float32 or scales.numel() < 2
            or scales.device != cache.device):
        raise KernelInputError(f"scales: a quantised cache needs float32 [2] scales (c_kv, "
                               f"k_pe) on {cache.device}")
    T = latent.shape[0]
    if (slot_mapping.shape != (T,) or slot_mapping.dtype not in (torch.int32, torch.int64)
            or slot_mapping.device != cache.device):
        raise KernelInputError(f"slot_mapping: expected [{T}] int32/int64 on {cache.device}")
    if T == 0:
        return
    P = RP - R
    fmax, mant, emin = fp8_grid(cache.dtype)
    _store_latent_q_kernel[(T,)](
        latent, cache, slot_mapping, scales, R, P, kv_quant.stored_dim(fmt, R, g),
        latent.stride(0), cache.stride(0), cache.stride(1), fmax, BS=cache.shape[1], FP4=fp4,
        BLOCK_W=triton.next_power_of_2(RP), NBR=fp4_blocks_padded(R),
        NBP=fp4_blocks_padded(P), MANT=mant, EMIN=emin,
        ROWS=g == "token_head", BLOCK_R=max(16, triton.next_power_of_2(R)),
        BLOCK_P=max(16, triton.next_power_of_2(P)), **NO_FMA)


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 scales: Optional[torch.Tensor] = None,
                 kv_lora_rank: Optional[int] = None) -> None:
    """latent [T, R + P] (c_kv ++ k_pe) -> cache [NB, BS, R + P] at slot_mapping [T] (int32/int64;
    -1 skips the row). latent must be in the cache's dtype; its row stride is free.
    A quantised cache (float8, or uint8 fp4_e2m1 rows of R/2 + R/16 + P/2 + P/16 bytes;
    kernels/kv_quant.py): latent in any float dtype, quantised here with ``scales`` float32 [2]
    (c_kv, k_pe) and ``kv_lora_rank`` = R, bit-identical to ``kv_quant.quantize`` per part."""
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        return _store_latent_quantised(latent, cache, slot_mapping, scales, kv_lora_rank)
    check_store_latent_args(latent, cache, slot_mapping)
    T = latent.shape[0]
    if T == 0:
        return
    NB, BS, W = cache.shape
    _store_latent_kernel[(T,)](latent, cache, slot_mapping, W, latent.stride(0),
                               cache.stride(0), cache.stride(1), BS=BS,
                               BLOCK_W=triton.next_power_of_2(W))
