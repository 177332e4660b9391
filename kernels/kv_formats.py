"""What each low-bit KV cache format stores (``cache.kv_cache_dtype``, docs/kv_cache.md): the
storage dtype, a row's width in storage elements, the format's largest value, and the fp8
element codec (stored = saturate(x / scale), read = stored * scale).

Rows: fp8 stores one element per value; fp4_e2m1 (NVFP4, ``kv_fp4.py``) packs two 4-bit codes
per byte and adds one E4M3 scale byte per 16 values; ``token_head`` rows
(``cache.kv_scale_granularity``, ``kv_rows.py``) end with their own inline scale. A cache tensor
tells its format by its dtype and its granularity by a mark set when it is allocated.
"""
from __future__ import annotations

from typing import Optional

import torch

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
GRANULARITIES = ("tensor", "token_head")  # cache.kv_scale_granularity
ROW_SCALE_BYTES = {"fp8": 2, "fp4_e2m1": 1}  # token_head: bf16 (fp8) / E8M0 (fp4) per row
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP4_BLOCK = 16  # values sharing one E4M3 block scale
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# tensor granularity: a per-layer scale covers this many times the first write's amax
SCALE_HEADROOM = 2.0


def format_max(fmt: str) -> float:
    if fmt in FP8_DTYPES:
        return float(torch.finfo(FP8_DTYPES[fmt]).max)
    if fmt == "fp4_e2m1":
        return E2M1_MAX * E4M3_MAX
    raise ValueError(f"kv_cache_dtype={fmt!r}: no scale for this format")


def storage_dtype(fmt: str, model_dtype: torch.dtype) -> torch.dtype:
    if fmt == "auto":
        return model_dtype
    if fmt in FP8_DTYPES:
        return FP8_DTYPES[fmt]
    if fmt == "fp4_e2m1":
        return torch.uint8
    raise ValueError(f"kv_cache_dtype={fmt!r}: must be one of {', '.join(FORMATS)}")


def row_scale_elems(fmt: str, granularity: str = "tensor") -> int:
    """Storage elements of a row's inline scale (token_head; 0 otherwise)."""
    if granularity != "token_head" or fmt == "auto":
        return 0
    return ROW_SCALE_BYTES["fp4_e2m1" if fmt == "fp4_e2m1" else "fp8"]


def stored_dim(fmt: str, dim: int, granularity: str = "tensor") -> int:
    """Storage elements for a row of ``dim`` values (fp4: packed bytes + block-scale bytes;
    token_head: + the row's inline scale)."""
    extra = row_scale_elems(fmt, granularity)
    if fmt == "fp4_e2m1":
        if dim % FP4_BLOCK:
            raise ValueError(f"fp4_e2m1 packs rows of a multiple of {FP4_BLOCK} values, got {dim}")
        return dim // 2 + dim // FP4_BLOCK + extra
    return dim + extra


def value_dim(fmt: str, stored: int, granularity: str = "tensor") -> int:
    """Inverse of ``stored_dim``."""
    stored -= row_scale_elems(fmt, granularity)
    if fmt == "fp4_e2m1":
        return stored * FP4_BLOCK // (FP4_BLOCK // 2 + 1)
    return stored


def fp4_split_fits(R: int, P: int, W: int, granularity: str = "tensor") -> bool:
    """Whether fp4_e2m1 rows of two parts (MLA's c_kv and k_pe: R and P values, each in whole
    blocks of 16) are W bytes wide."""
    return not (R % 16 or P % 16) and (stored_dim("fp4_e2m1", R, granularity)
                                       + stored_dim("fp4_e2m1", P, granularity)) == W


def fp8_grid(dtype: torch.dtype) -> tuple[float, int, int]:
    """(largest value, mantissa bits, least normal exponent) of a float8 storage dtype, the Triton
    stores' FMAX / MANT / EMIN (``triton_kv_scales._round_fp8``); (0, 3, -6) for other dtypes."""
    fmax = float(torch.finfo(dtype).max) if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 0.0
    return (fmax, 2, -14) if dtype == torch.float8_e5m2 else (fmax, 3, -6)


def format_of(cache: torch.Tensor, model_dtype: Optional[torch.dtype] = None) -> str:
    """The format a cache tensor is stored in, from its dtype (uint8: fp4_e2m1)."""
    if cache.dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if cache.dtype == torch.float8_e5m2:
        return "fp8_e5m2"
    if cache.dtype == torch.uint8:
        return "fp4_e2m1"
    return "auto"


def granularity_of(cache: torch.Tensor) -> str:
    """``tensor`` or ``token_head``: marked by ``kv_quant.register``; an unmarked uint8 (fp4)
    cache is read from its row width (tensor rows are a multiple of 9 bytes, token_head rows
    are not)."""
    g = getattr(cache, "kv_granularity", None)
    if g is not None:
        return g
    if cache.dtype == torch.uint8 and cache.dim() and cache.shape[-1] % 9:
        return "token_head"
    return "tensor"


# ---- fp8 elements ----
def quant_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x / scale saturated to the format's max (scale 0: zeros)."""
    fmax = format_max(fmt)
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(1e-38), torch.zeros_like(scale))
    return (x.float() * inv).clamp(-fmax, fmax).to(FP8_DTYPES[fmt])


def dequant_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)
