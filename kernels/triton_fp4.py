"""The NVFP4 (``fp4_e2m1``) KV row in Triton: quantising a row in the store kernels
(``_quant_fp4_row``, GQA ``triton_kv_cache.store_kv`` and MLA ``triton_mla_store``) and reading a
tile back (``_fp4_tile``), bit for bit as ``kv_fp4.py`` does (docs/kv_cache.md).

Block scales by least squared error, as ``kv_fp4.block_scales``: for each candidate amax / d,
d = 6, 5.5, 5, 4.5, 4 (``kv_fp4.FP4_DIVISORS``), the E4M3-rounded scale codes the block and the
block's squared error against the dequantised values is summed in float32 in the torch
quantiser's order (2j + 2j+1, then pairs of pairs); a candidate replaces the best only if its
error is strictly lower. The kernels that call ``_quant_fp4_row`` are launched with
``enable_fp_fusion=False`` (``NO_FMA``): a multiply-add fused into one FMA rounds once where
torch rounds twice, and would change which candidate wins.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import kv_fp4, kv_rows
from .triton_kv_scales import _round_fp8

NDIV = tl.constexpr(len(kv_fp4.FP4_DIVISORS))  # candidate d = 6 - 0.5 j, j < NDIV
if kv_fp4.FP4_DIVISORS != tuple(6.0 - 0.5 * j for j in range(len(kv_fp4.FP4_DIVISORS))):
    raise ImportError("triton_fp4 takes the block-scale candidates 6 - 0.5 j; kv_fp4 has "
                      f"{kv_fp4.FP4_DIVISORS}")
ROW_SCALE_DIV = tl.constexpr(kv_rows.ROW_SCALE_DIV)  # token_head: 2**e >= amax / this
NO_FMA = dict(enable_fp_fusion=False)  # launch option of every kernel quantising fp4 rows


def fp4_blocks_padded(D: int) -> int:
    return max(2, triton.next_power_of_2(D // 16))


@triton.jit
def _e2m1_code(y):
    """fp32 y (already divided by its scale) -> 4-bit E2M1 code (int32): magnitude index = the
    rounding boundaries (kv_fp4._E2M1_BOUNDS) strictly below |y| (saturating at 6), sign bit 8
    for negative non-zero codes."""
    a = tl.abs(y)
    m = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
         + (a > 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32)
         + (a > 5.0).to(tl.int32))
    return tl.where((y < 0) & (m > 0), m | 8, m)


@triton.jit
def _e2m1_value(code):
    """4-bit code (int32) -> its E2M1 value (fp32, exact): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6."""
    m = code & 7
    mf = m.to(tl.float32)
    mag = tl.where(m < 4, mf * 0.5, tl.where(m < 6, mf - 2.0, mf * 2.0 - 8.0))
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def _fp4_tile(row, d, mask, D, gscale):
    """An fp4_e2m1 tile (kernels/kv_fp4.py): row [BN] uint8 pointers to each token's row of
    D/2 packed codes then D/16 E4M3 block scales -> values [BN, BD] fp32 (x gscale)."""
    byte = tl.load(row[:, None] + d[None, :] // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((d[None, :] % 2) * 4)) & 0xF
    sb = tl.load(row[:, None] + D // 2 + d[None, :] // 16, mask=mask, other=0)
    bs = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return _e2m1_value(code) * bs * gscale


@triton.jit
def _candidate(xe, xo, amax, gscale, ginv, d, NBP: tl.constexpr):
    """Block scale amax / d (E4M3, as stored), its codes and the blocks' squared errors."""
    bs = _round_fp8(tl.minimum(tl.math.div_rn(amax, d) * ginv, 448.0), 448.0, 3, -6)
    eff = bs * gscale  # bs: exact E4M3 values in fp32
    inv = tl.where(eff > 0, tl.math.div_rn(1.0, tl.where(eff > 0, eff, 1.0)), 0.0)[:, None]
    ce = _e2m1_code(xe * inv)
    co = _e2m1_code(xo * inv)
    de = _e2m1_value(ce) * eff[:, None] - xe
    do = _e2m1_value(co) * eff[:, None] - xo
    s = de * de + do * do  # [NBP, 8]: values 2j + 2j+1 (no FMA: NO_FMA)
    s = tl.sum(tl.reshape(s, (NBP, 4, 2)), 2)
    s = tl.sum(tl.reshape(s, (NBP, 2, 2)), 2)
    return bs, ce, co, tl.sum(s, 1)


@triton.jit
def _quant_fp4_row(src, dst, D, gscale, NBP: tl.constexpr, ROWSCALE: tl.constexpr = False):
    """One row of D fp values at ``src`` -> fp4_e2m1 at ``dst`` (uint8: D/2 packed codes, then
    D/16 E4M3 block scales), as ``kv_fp4.quant_fp4`` writes it, bit for bit: each block's scale
    the least-squared-error candidate amax / d (E4M3, saturated at 448), codes = E2M1 of
    x / (block scale x gscale), ties rounded towards zero. Element 2j is the low nibble of byte
    j. NBP: blocks, padded to a power of two; the tile is [NBP, 8] bytes (even and odd elements
    loaded apart). ROWSCALE (token_head): ``gscale`` is the row's own 2**e
    (``kv_rows.e8m0_exponent``), its byte e + 127 stored after the block scales."""
    b = tl.arange(0, NBP)[:, None]
    i = tl.arange(0, 8)[None, :]
    j = b * 8 + i  # [NBP, 8] byte index
    ok = j < D // 2
    xe = tl.load(src + 2 * j, mask=ok, other=0.0).to(tl.float32)
    xo = tl.load(src + 2 * j + 1, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.maximum(tl.abs(xe), tl.abs(xo)), 1)  # [NBP]
    if ROWSCALE:  # the least 2**e >= row amax / (4 x 448), from the float32 bits
        bits = tl.math.div_rn(tl.max(amax, 0), ROW_SCALE_DIV).to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        e = tl.minimum(tl.maximum(e, -126), 126)
        gscale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        tl.store(dst + D // 2 + D // 16, (e + 127).to(tl.uint8))
    # IEEE-rounded divisions (div_rn), as torch's: a GPU's default fp32 division is not
    ginv = tl.where(gscale > 0, tl.math.div_rn(1.0, tl.where(gscale > 0, gscale, 1.0)), 0.0)
    bs, ce, co, err = _candidate(xe, xo, amax, gscale, ginv, 6.0, NBP)
    for c in tl.static_range(1, NDIV):
        bs_c, ce_c, co_c, err_c = _candidate(xe, xo, amax, gscale, ginv, 6.0 - 0.5 * c, NBP)
        better = err_c < err  # strictly: a tie keeps the earlier candidate
        bs = tl.where(better, bs_c, bs)
        ce = tl.where(better[:, None], ce_c, ce)
        co = tl.where(better[:, None], co_c, co)
        err = tl.where(better, err_c, err)
    tl.store(dst + j, (ce | (co << 4)).to(tl.uint8), mask=ok)
    bb = tl.arange(0, NBP)
    tl.store(dst + D // 2 + bb, bs.to(tl.float8e4nv).to(tl.uint8, bitcast=True),
             mask=bb < D // 16)
