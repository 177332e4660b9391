"""Scales of the low-bit KV cache in Triton, bit-exact with ``kv_quant.py``: rounding to the
float8 grid (``_round_fp8``), and the ``token_head`` row scales (``cache.kv_scale_granularity``):
a row's bfloat16 scale (fp8) computed and written after the row, or read back, and the fp4
row's E8M0 exponent read back (it is written by ``triton_fp4._quant_fp4_row``). Used by
``triton_kv_cache.py`` (GQA store and ``_kv_tile``), ``triton_fp4.py`` (fp4 rows),
``triton_mla_store.py`` (latent store) and ``triton_mla.py`` (latent decode).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_fp8(x, FMAX, MANT: tl.constexpr, EMIN: tl.constexpr):
    """fp32 x -> the nearest float8 value (round half to even, saturated to +-FMAX), still in
    fp32, so that the cast to the float8 type is exact (no reliance on the backend's rounding:
    the interpreter's direct cast misrounds across binades). Exponent read from the bits."""
    a = tl.minimum(tl.abs(x), FMAX)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)  # subnormals share the smallest normal binade's ulp
    ulp = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a / ulp + 12582912.0) - 12582912.0) * ulp  # 1.5 * 2**23: fp32 add rounds to even
    r = tl.minimum(r, FMAX)
    return tl.where(x < 0, -r, r)


@triton.jit
def _bf16_round(x):
    """fp32 x >= 0 (finite) -> the nearest bfloat16 value (ties to even), still fp32; and its
    16 bits (int32), as torch's ``.to(torch.bfloat16)`` rounds."""
    b = x.to(tl.int32, bitcast=True)
    hi = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return (hi << 16).to(tl.float32, bitcast=True), hi


@triton.jit
def _row_scale_fp8(base, d, mask, D):
    """The bf16 scale stored after each fp8 row's D elements (``base`` [BN] row pointers), as
    fp32 [BN, BD] (repeated along d, loaded under the tile's mask)."""
    off = base[:, None] + D + d[None, :] * 0
    lo = tl.load(off, mask=mask, other=0.0).to(tl.uint8, bitcast=True).to(tl.int32)
    hi = tl.load(off + 1, mask=mask, other=0.0).to(tl.uint8, bitcast=True).to(tl.int32)
    return ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)


@triton.jit
def _row_scale_fp4(base, d, mask, D):
    """2**(e - 127) from the E8M0 byte after each fp4 row's codes and block scales, [BN, BD]."""
    e = tl.load(base[:, None] + D // 2 + D // 16 + d[None, :] * 0, mask=mask, other=127)
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quant_fp8_part(src, dst, n, FMAX, BLOCK: tl.constexpr, MANT: tl.constexpr,
                    EMIN: tl.constexpr):
    """token_head: n values at ``src`` -> n float8 at ``dst`` then the part's bf16 scale bytes
    (``kv_quant.quant_rows``, bit for bit; -0 stored as +0)."""
    w = tl.arange(0, BLOCK)
    mask = w < n
    x = tl.load(src + w, mask=mask, other=0.0).to(tl.float32)
    s, sb = _bf16_round(tl.math.div_rn(tl.max(tl.abs(x), 0), FMAX))
    inv = tl.where(s > 0, tl.math.div_rn(1.0, tl.where(s > 0, s, 1.0)), 0.0)
    y = _round_fp8(x * inv, FMAX, MANT, EMIN)
    ety = dst.dtype.element_ty
    tl.store(dst + w, tl.where(y == 0, 0.0, y).to(ety), mask=mask)
    tl.store(dst + n, (sb & 0xFF).to(tl.uint8).to(ety, bitcast=True))
    tl.store(dst + n + 1, (sb >> 8).to(tl.uint8).to(ety, bitcast=True))
