"""Low-bit KV cache formats (``cache.kv_cache_dtype``): quantise on store, dequantise on read.
The one entry point per direction (``quantize``, ``dequantize``), the per-layer scales, and
every public name of the formats' modules: ``kv_formats.py`` (formats, storage dtypes, row
widths, the fp8 codec), ``kv_fp4.py`` (NVFP4 rows), ``kv_rows.py`` (``token_head`` rows).

Formats: ``auto`` (the model dtype, no scales), ``fp8_e4m3`` / ``fp8_e5m2`` (stored =
saturate(x / scale), read = stored * scale), ``fp4_e2m1``. With ``tensor`` granularity a
layer's scales, ``scales_of(cache)`` float32 ``[2]`` (keys, values), are zero until the first
non-zero write sets ``SCALE_HEADROOM * amax / fmt_max`` once, device-side, never requantised;
with ``token_head`` they stay registered, zero, unused.
docs/kv_cache.md, "Scales".
"""
from __future__ import annotations

from typing import Optional

import torch

from .kv_formats import (E2M1_MAX, E4M3_MAX, FORMATS, FP4_BLOCK, FP8_DTYPES, GRANULARITIES,
                         ROW_SCALE_BYTES, SCALE_HEADROOM, dequant_fp8, format_max, format_of,
                         granularity_of, quant_fp8, row_scale_elems, storage_dtype, stored_dim,
                         value_dim)
from .kv_fp4 import E2M1_VALUES, FP4_DIVISORS, dequant_fp4, quant_fp4
from .kv_rows import dequant_rows, e8m0_exponent, quant_rows, row_scales

__all__ = ["FORMATS", "GRANULARITIES", "ROW_SCALE_BYTES", "FP8_DTYPES", "FP4_BLOCK", "E4M3_MAX",
           "E2M1_MAX", "E2M1_VALUES", "FP4_DIVISORS", "SCALE_HEADROOM", "format_max",
           "storage_dtype", "row_scale_elems", "stored_dim", "value_dim", "format_of",
           "granularity_of", "register", "scales_of", "update_scales", "scales_for_write",
           "quant_fp8", "dequant_fp8", "quant_fp4", "dequant_fp4", "e8m0_exponent",
           "quant_rows", "row_scales", "dequant_rows", "quantize", "dequantize", "round_trip"]


# ---- per-layer scales: owned by the cache tensor they describe (an attribute on it) ----
def register(cache: torch.Tensor, granularity: Optional[str] = None) -> torch.Tensor:
    """Fresh (unset, zero) float32 [2] scales for a newly allocated quantised cache (and its
    scale granularity, when given)."""
    cache.kv_scales = torch.zeros(2, dtype=torch.float32, device=cache.device)
    if granularity is not None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"kv_scale_granularity={granularity!r}: must be one of "
                             f"{', '.join(GRANULARITIES)}")
        cache.kv_granularity = granularity
    return cache.kv_scales


def scales_of(cache: torch.Tensor) -> torch.Tensor:
    """float32 [2] (keys, values) scales of a quantised layer cache (registered if new)."""
    s = getattr(cache, "kv_scales", None)
    return register(cache) if s is None else s


def update_scales(scales: torch.Tensor, fmt: str, *xs: torch.Tensor) -> None:
    """Set scales[i] from xs[i]'s amax where still unset (0); keep it otherwise. No host sync."""
    amax = torch.stack([x.detach().abs().amax().float() if x.numel() else
                        x.new_zeros((), dtype=torch.float32) for x in xs])
    new = amax * (SCALE_HEADROOM / format_max(fmt))
    scales[:len(xs)].copy_(torch.where(scales[:len(xs)] > 0, scales[:len(xs)], new))


def scales_for_write(cache: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
    """The float32 [2] per-layer scales a write of ``xs`` (keys, values; MLA: c_kv, k_pe) into a
    quantised ``cache`` uses: ``tensor`` granularity sets the unset ones from ``xs``
    (``update_scales``); ``token_head`` leaves them unset (each row carries its own)."""
    scales = scales_of(cache)
    if granularity_of(cache) == "tensor":
        update_scales(scales, format_of(cache), *xs)
    return scales


# ---- one entry point per direction ----
def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str,
             granularity: str = "tensor") -> torch.Tensor:
    """``tensor``: with the per-layer ``scale``; ``token_head``: each row its own (``scale``
    unused)."""
    if granularity == "token_head":
        return quant_rows(x, fmt)
    if fmt in FP8_DTYPES:
        return quant_fp8(x, scale, fmt)
    if fmt == "fp4_e2m1":
        return quant_fp4(x, scale)
    raise ValueError(f"kv_cache_dtype={fmt!r}: not a quantised format")


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype,
               granularity: str = "tensor") -> torch.Tensor:
    if granularity == "token_head":
        return dequant_rows(q, fmt, dtype)
    if fmt in FP8_DTYPES:
        return dequant_fp8(q, scale, dtype)
    if fmt == "fp4_e2m1":
        return dequant_fp4(q, scale, dtype)
    raise ValueError(f"kv_cache_dtype={fmt!r}: not a quantised format")


def round_trip(x: torch.Tensor, fmt: str, scale: Optional[torch.Tensor] = None,
               granularity: str = "tensor") -> torch.Tensor:
    """quantize then dequantize with a per-tensor scale from x itself, or (token_head) each
    row's own (tests, bench)."""
    if granularity == "token_head":
        return dequant_rows(quant_rows(x, fmt), fmt, x.dtype)
    if scale is None:
        scale = torch.zeros(1, device=x.device)
        update_scales(scale, fmt, x)
    return dequantize(quantize(x, scale[0] if scale.dim() else scale, fmt),
                      scale[0] if scale.dim() else scale, fmt, x.dtype)
