"""Low-bit KV cache formats (``cache.kv_cache_dtype``): quantise on store, dequantise on read.

Formats (docs/kv_cache.md):

* ``auto``: the model dtype, stored as is (no scales; bit-identical to a plain cache).
* ``fp8_e4m3`` / ``fp8_e5m2``: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` elements, one
  float32 scale per layer for keys and one for values (vLLM's ``k_scale`` / ``v_scale``):
  stored = saturate(x / scale), read = stored * scale.
* ``fp4_e2m1``: the NVFP4 layout. Along the last dimension, blocks of 16 values share one FP8
  E4M3 scale; every element is a 4-bit E2M1 code (sign, 2 exponent bits, 1 mantissa bit:
  magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6), two codes per byte (element 2j in the low nibble,
  2j+1 in the high nibble), plus one float32 scale per tensor (per layer, keys and values
  apart). A row of D values is ``D/2`` packed bytes followed by ``D/16`` scale bytes (E4M3
  bits), ``uint8 [..., D/2 + D/16]``: the scales travel with the token (block copies, prefix
  reuse and transfers move them with the values). value = E2M1(code) * E4M3(block) * global.

The per-layer float32 scales are set **once, from the first non-zero write** (a prefill, or
whatever a CUDA-graph warm-up stores first) and then kept: ``scale = SCALE_HEADROOM * amax /
fmt_max`` (fp8: the format's max; fp4: 6 x 448, so that a block as large as the first amax x
headroom gets the largest E4M3 block scale). Values beyond the headroom saturate; nothing is
ever requantised. The update is device-side (``torch.where``), no host synchronisation.
The scales of a layer's cache live in ``scales_of(cache)``: float32 ``[2]`` (keys, values),
zero until the first write, registered when the cache is allocated (``KVCacheSpec.allocate``).
"""
from __future__ import annotations

from typing import Optional

import torch

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP4_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
SCALE_HEADROOM = 2.0
# E2M1 magnitudes by 3-bit code, and the rounding boundaries between neighbours
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# ablation knob (perf/bench_kv_quant.py): False stores every block scale as the constant that
# makes the per-tensor scale alone cover the first amax (a per-tensor-only 4-bit format)
FP4_BLOCK_SCALES = True


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


def stored_dim(fmt: str, dim: int) -> int:
    """Storage elements for a row of ``dim`` values (fp4: packed bytes + block-scale bytes)."""
    if fmt == "fp4_e2m1":
        if dim % FP4_BLOCK:
            raise ValueError(f"fp4_e2m1 packs rows of a multiple of {FP4_BLOCK} values, got {dim}")
        return dim // 2 + dim // FP4_BLOCK
    return dim


def value_dim(fmt: str, stored: int) -> int:
    """Inverse of ``stored_dim``."""
    if fmt == "fp4_e2m1":
        return stored * FP4_BLOCK // (FP4_BLOCK // 2 + 1)
    return stored


def format_of(cache: torch.Tensor, model_dtype: Optional[torch.dtype] = None) -> str:
    """The format a cache tensor is stored in, from its dtype (uint8: fp4_e2m1)."""
    if cache.dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if cache.dtype == torch.float8_e5m2:
        return "fp8_e5m2"
    if cache.dtype == torch.uint8:
        return "fp4_e2m1"
    return "auto"


# ---- per-layer scales: owned by the cache tensor they describe (an attribute on it) ----
def register(cache: torch.Tensor) -> torch.Tensor:
    """Fresh (unset, zero) float32 [2] scales for a newly allocated quantised cache."""
    cache.kv_scales = torch.zeros(2, dtype=torch.float32, device=cache.device)
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


# ---- fp8 ----
def quant_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x / scale saturated to the format's max (scale 0: zeros)."""
    fmax = format_max(fmt)
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(1e-38), torch.zeros_like(scale))
    return (x.float() * inv).clamp(-fmax, fmax).to(FP8_DTYPES[fmt])


def dequant_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


# ---- fp4 (NVFP4) ----
# per device: made once (the first call runs before any CUDA-graph capture). "lut": E2M1 value
# by 4-bit code (code = sign << 3 | magnitude index); "pairs": the two values of a packed byte
_CONST: dict = {}


def _const(name: str, device) -> torch.Tensor:
    key = (name, str(device))
    t = _CONST.get(key)
    if t is None:
        if name == "pairs":  # byte -> its two values (low nibble first): one gather per byte
            lut = _const("lut", "cpu")
            b = torch.arange(256)
            t = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).to(device)  # [256, 2]
        else:
            vals = {"lut": E2M1_VALUES + tuple(-v for v in E2M1_VALUES),
                    "bounds": _E2M1_BOUNDS}[name]
            t = torch.tensor(vals, dtype=torch.float32, device=device)
        _CONST[key] = t
    return t


def quant_fp4(x: torch.Tensor, gscale: torch.Tensor,
              block_scales: Optional[bool] = None) -> torch.Tensor:
    """x [..., D] (D % 16 == 0) -> uint8 [..., D/2 + D/16]: packed codes, then E4M3 block scales.
    ``gscale``: the per-tensor float32 scale (0: stores zeros)."""
    block_scales = FP4_BLOCK_SCALES if block_scales is None else block_scales
    *lead, D = x.shape
    nb = D // FP4_BLOCK
    xb = x.float().reshape(*lead, nb, FP4_BLOCK)
    g = gscale.float()
    ginv = torch.where(g > 0, 1.0 / g.clamp_min(1e-38), torch.zeros_like(g))
    if block_scales:  # E4M3 block scale in units of the global scale, saturated at 448
        bs = (xb.abs().amax(-1) / E2M1_MAX * ginv).clamp(max=E4M3_MAX)
    else:  # per-tensor only: the block scale is fixed so that global x it = first amax / 6
        bs = torch.full(xb.shape[:-1], E4M3_MAX / SCALE_HEADROOM, device=x.device)
    bs8 = bs.to(torch.float8_e4m3fn)  # [..., nb]
    eff = bs8.float() * g  # the scale each block's codes are multiplied by on read
    y = xb * torch.where(eff > 0, 1.0 / eff.clamp_min(1e-38), torch.zeros_like(eff))[..., None]
    bounds = _const("bounds", x.device)
    mag = torch.bucketize(y.abs().clamp(max=E2M1_MAX), bounds)  # 0..7, ties round down
    code = (mag | ((y < 0) & (mag > 0)).to(mag.dtype) << 3).to(torch.uint8).reshape(*lead, D)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)  # [..., D/2]
    return torch.cat([packed, bs8.view(torch.uint8)], dim=-1)


def dequant_fp4(q: torch.Tensor, gscale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., D/2 + D/16] -> [..., D] in ``dtype``."""
    *lead, W = q.shape
    D = value_dim("fp4_e2m1", W)
    nb = D // FP4_BLOCK
    packed, bs = q[..., :D // 2], q[..., D // 2:]
    vals = torch.index_select(_const("pairs", q.device), 0, packed.reshape(-1).int())
    vals = vals.view(*lead, nb, FP4_BLOCK)  # [..., nb, 16]: element 2j low nibble, 2j+1 high
    scale = bs.contiguous().view(torch.float8_e4m3fn).float() * gscale.float()  # [..., nb]
    return (vals * scale[..., None]).reshape(*lead, D).to(dtype)


# ---- one entry point per direction ----
def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt in FP8_DTYPES:
        return quant_fp8(x, scale, fmt)
    if fmt == "fp4_e2m1":
        return quant_fp4(x, scale)
    raise ValueError(f"kv_cache_dtype={fmt!r}: not a quantised format")


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    if fmt in FP8_DTYPES:
        return dequant_fp8(q, scale, dtype)
    if fmt == "fp4_e2m1":
        return dequant_fp4(q, scale, dtype)
    raise ValueError(f"kv_cache_dtype={fmt!r}: not a quantised format")


def round_trip(x: torch.Tensor, fmt: str, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """quantize then dequantize with a per-tensor scale from x itself (tests, bench)."""
    if scale is None:
        scale = torch.zeros(1, device=x.device)
        update_scales(scale, fmt, x)
    return dequantize(quantize(x, scale[0] if scale.dim() else scale, fmt),
                      scale[0] if scale.dim() else scale, fmt, x.dtype)
