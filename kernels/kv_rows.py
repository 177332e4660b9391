"""``token_head`` rows (``cache.kv_scale_granularity=token_head``): every stored row (one token's
keys or values of one KV head; MLA: one part of one token's latent) carries its own scale
inline, after its values, so a row's bytes depend only on that row.

* fp8: the row's ``D`` elements then its bfloat16 scale ``bf16(amax / fmt_max)`` (2 bytes,
  little-endian): ``D + 2`` storage elements; -0 is stored as +0.
* fp4: the NVFP4 row (``kv_fp4.py``) then one E8M0 byte ``e + 127``, ``2**e`` the least power
  of two >= amax / (4 x 448) (``ROW_SCALE_DIV``).

The Triton store kernels write the same bytes.
docs/kv_cache.md, "Layouts".
"""
from __future__ import annotations

import torch

from .kv_fp4 import FP4_DIVISORS, dequant_fp4, quant_fp4
from .kv_formats import (E4M3_MAX, FP8_DTYPES, dequant_fp8, format_max, quant_fp8, storage_dtype,
                         stored_dim)

# fp4 rows: 2**e >= amax / ROW_SCALE_DIV, room for the least candidate divisor (1792; the
# Triton store uses the same constant)
ROW_SCALE_DIV = min(FP4_DIVISORS) * E4M3_MAX


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """int32 e in [-126, 127] -> float32 2**e (exact, from the bits)."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """float32 amax -> int32 e, the least power of two 2**e >= amax / (4 x 448), clamped to
    [-126, 126] (read from the float32 bits: exact, and the same in the Triton store)."""
    amax = amax.float()
    r = amax / amax.new_full((), ROW_SCALE_DIV)  # IEEE on every device (not x reciprocal)
    bits = r.contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return e.clamp(-126, 126)


def quant_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., D] -> rows with their own inline scale: fp8 [..., D + 2] (bf16 scale bytes last),
    fp4 uint8 [..., D/2 + D/16 + 1] (E8M0 byte last)."""
    if not x.numel():  # nothing to write (an empty micro-batch): the stored shape, no rows
        D = x.shape[-1]
        return torch.empty((*x.shape[:-1], stored_dim(fmt, D, "token_head")),
                           dtype=storage_dtype(fmt, x.dtype), device=x.device)
    amax = x.detach().float().abs().amax(-1, keepdim=True)
    if fmt in FP8_DTYPES:
        s = (amax / format_max(fmt)).to(torch.bfloat16)  # [..., 1], round to nearest even
        q = quant_fp8(x, s.float(), fmt).view(torch.uint8)
        q = torch.where(q == 0x80, 0, q).to(torch.uint8)  # -0 stored as +0 (one byte per value)
        return torch.cat([q, s.view(torch.uint8)], -1).view(FP8_DTYPES[fmt])
    if fmt == "fp4_e2m1":
        e = e8m0_exponent(amax)  # [..., 1]
        return torch.cat([quant_fp4(x, _pow2(e)), (e + 127).to(torch.uint8)], -1)
    raise ValueError(f"kv_cache_dtype={fmt!r}: not a quantised format")


def row_scales(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """The inline scale of each stored token_head row: float32 [..., 1]."""
    if not q.numel():
        return torch.zeros((*q.shape[:-1], 1), dtype=torch.float32, device=q.device)
    if fmt in FP8_DTYPES:
        return q[..., -2:].contiguous().view(torch.bfloat16).float()
    return _pow2(q[..., -1:].to(torch.int32) - 127)


def dequant_rows(q: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quant_rows`` (values in ``dtype``)."""
    s = row_scales(q, fmt)
    if fmt in FP8_DTYPES:
        return dequant_fp8(q[..., :-2], s, dtype)
    return dequant_fp4(q[..., :-1], s, dtype)
