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

Scale granularity (``cache.kv_scale_granularity``):

* ``tensor``: the per-layer float32 scales below (vLLM's ``k_scale`` / ``v_scale``).
* ``token_head``: every stored row (one token's keys or values of one KV head; MLA: one part
  of one token's latent) carries its own scale inline, after its values, so a row's bytes
  depend only on that row (not on the batch, micro-batch, TP split or transfer). fp8: the row's
  ``D`` elements then a bfloat16 scale (2 bytes, ``bf16(amax / fmt_max)``), ``D + 2`` storage
  elements. fp4: ``D/2 + D/16`` bytes then one E8M0 byte ``e + 127`` replacing the per-tensor
  float32 scale with ``2**e``, the least power of two >= amax / (6 x 448): the row's largest E4M3
  block scale lands in (224, 448]. The per-layer scales stay registered (zero, unused).

The per-layer float32 scales (``tensor``) are set **once, from the first non-zero write** (a prefill, or
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
GRANULARITIES = ("tensor", "token_head")  # cache.kv_scale_granularity
ROW_SCALE_BYTES = {"fp8": 2, "fp4_e2m1": 1}  # token_head: bf16 (fp8) / E8M0 (fp4) per row
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
    """``tensor`` or ``token_head``: marked by ``register``; an unmarked uint8 (fp4) cache is
    read from its row width (tensor rows are a multiple of 9 bytes, token_head rows are not)."""
    g = getattr(cache, "kv_granularity", None)
    if g is not None:
        return g
    if cache.dtype == torch.uint8 and cache.dim() and cache.shape[-1] % 9:
        return "token_head"
    return "tensor"


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


# ---- token_head: one scale per row, stored inline after the row's values ----
def _pow2(e: torch.Tensor) -> torch.Tensor:
    """int32 e in [-126, 127] -> float32 2**e (exact, from the bits)."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """float32 amax -> int32 e, the least power of two 2**e >= amax / (6 x 448), clamped to
    [-126, 126] (read from the float32 bits: exact, and the same in the Triton store)."""
    r = amax.float() / (E2M1_MAX * E4M3_MAX)
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
