"""The NVFP4 (``fp4_e2m1``) KV row codec in torch: values -> packed E2M1 codes and E4M3 block
scales, and back.

A row of D values is ``D/2`` code bytes (value 2j in the low nibble of byte j, 2j+1 in the
high one) then ``D/16`` E4M3 block-scale bytes: value = E2M1(code) x E4M3(block scale) x g,
``g`` the layer's float32 (``tensor``) or the row's 2**e (``token_head``, ``kv_rows.py``).
Each block's scale is amax / d for the d in ``FP4_DIVISORS`` whose stored block gives the least
squared error (summed in float32 in the fixed pairwise order the Triton store uses too; ties to
d = 6), so a block is never worse than with amax / 6. ``scale_rule`` selects the ablations
``amax/6`` and ``per-tensor``.
docs/kv_cache.md, "Layouts".
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from .kv_formats import E2M1_MAX, E4M3_MAX, FP4_BLOCK, SCALE_HEADROOM, value_dim

# E2M1 magnitudes by 3-bit code, and the rounding boundaries between neighbours
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# the block-scale candidates amax / d, in the order that breaks ties (measured by a study kept in docs/kv_cache.md)
FP4_DIVISORS = (6.0, 5.5, 5.0, 4.5, 4.0)
SCALE_RULES = ("lsq", "amax/6", "per-tensor")
_RULE = ["lsq"]

# per device: made once (the first call runs before any CUDA-graph capture). "lut": E2M1 value
# by 4-bit code (code = sign << 3 | magnitude index); "pairs": the two values of a packed byte;
# a tuple: those block-scale divisors
_CONST: dict = {}


@contextlib.contextmanager
def scale_rule(rule: str):
    """While active, ``quant_fp4`` picks block scales by ``rule`` (one of ``SCALE_RULES``)."""
    if rule not in SCALE_RULES:
        raise ValueError(f"fp4 scale rule {rule!r}: must be one of {', '.join(SCALE_RULES)}")
    old, _RULE[0] = _RULE[0], rule
    try:
        yield
    finally:
        _RULE[0] = old


def _const(name: str, device) -> torch.Tensor:
    key = (name, str(device))
    t = _CONST.get(key)
    if t is None:
        if name == "pairs":  # byte -> its two values (low nibble first): one gather per byte
            lut = _const("lut", "cpu")
            b = torch.arange(256)
            t = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).to(device)  # [256, 2]
        else:  # "lut", or a tuple of block-scale divisors
            vals = name if isinstance(name, tuple) else E2M1_VALUES + tuple(-v for v in E2M1_VALUES)
            t = torch.tensor(vals, dtype=torch.float32, device=device)
        _CONST[key] = t
    return t


def _magnitudes(xb: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """xb [..., nb, 16] fp32, eff [..., nb] (block scale x g) -> E2M1 magnitude index (uint8,
    0..7) of |x / eff| (x times the IEEE reciprocal), ties towards zero, saturating at 6."""
    inv = torch.where(eff > 0, 1.0 / eff.clamp_min(1e-38), torch.zeros_like(eff))
    a = (xb * inv[..., None]).abs()
    # how many bounds lie below |y|, counted as 7 less the bounds at or above it so that NaN
    # gets 7 as torch.bucketize gives it; one byte per element (3x faster than bucketize)
    above = (a <= _E2M1_BOUNDS[0]).view(torch.uint8)
    for b in _E2M1_BOUNDS[1:]:
        above.add_((a <= b).view(torch.uint8))
    return len(_E2M1_BOUNDS) - above


def _with_sign(xb: torch.Tensor, mag: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8): the magnitude index, sign bit 3 where x < 0, the code is not zero
    and the scale is positive (a zero or NaN scale codes every value as +0 or NaN's 7)."""
    neg = (xb < 0) & (mag > 0) & (eff > 0)[..., None]
    return mag | (neg.view(torch.uint8) << 3)


def block_sq_error(xb: torch.Tensor, mag: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """Squared error of each block as dequantisation reads it: sum (E2M1(code) x eff - x)^2,
    float32, added in pairs (2j + 2j+1, then pairs of those, ...) -> [..., nb]. Taken as
    (E2M1(mag) x eff - |x|)^2: the code's sign is x's, and negation is exact, so each term is
    the same float as the signed one."""
    v = _const("lut", xb.device)[mag.int()]
    d = v * eff[..., None] - xb.abs()
    s = d * d
    while s.shape[-1] > 1:
        s = s[..., 0::2] + s[..., 1::2]
    return s[..., 0]


def block_scales(xb: torch.Tensor, g: torch.Tensor, rule: Optional[str] = None,
                 divisors: Sequence[float] = FP4_DIVISORS):
    """xb [..., nb, 16] fp32, ``g`` the second-level scale (broadcasting over [..., nb]) ->
    (E4M3 block scales [..., nb] (float8_e4m3fn), codes [..., nb, 16] uint8) by ``rule``
    (``divisors``: the lsq candidates; other sets were measured by the study in docs/kv_cache.md)."""
    rule = rule or _RULE[0]
    ginv = torch.where(g > 0, 1.0 / g.clamp_min(1e-38), torch.zeros_like(g))
    if rule == "per-tensor":  # the block scale fixed: g x it covers the first amax x headroom
        bs8 = torch.full(xb.shape[:-1], E4M3_MAX / SCALE_HEADROOM,
                         device=xb.device).to(torch.float8_e4m3fn)
    else:
        amax = xb.abs().amax(-1)  # [..., nb]
        # amax / d by a device tensor: an IEEE division on every device (CUDA would multiply by
        # the reciprocal of a host scalar), as the Triton store's div_rn; every candidate at
        # once, [C, ..., nb]
        dv = _const((E2M1_MAX,) if rule == "amax/6" else tuple(divisors), xb.device)
        dv = dv.view(-1, *[1] * amax.dim())
        bs8 = (amax / dv * ginv).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    eff = bs8.float() * g  # what each code is multiplied by on read
    mag = _magnitudes(xb, eff)
    if rule == "lsq":  # least error; argmin returns the first of equal minima (the earlier d)
        pick = block_sq_error(xb, mag, eff).argmin(0, keepdim=True)  # [1, ..., nb]
        bs8 = bs8.view(torch.uint8).gather(0, pick).view(torch.float8_e4m3fn)
        mag = mag.gather(0, pick[..., None].expand(1, *mag.shape[1:]))
        eff = bs8.float() * g
    if rule != "per-tensor":
        bs8, mag, eff = bs8[0], mag[0], eff[0]
    return bs8, _with_sign(xb, mag, eff)


def quant_fp4(x: torch.Tensor, gscale: torch.Tensor, rule: Optional[str] = None) -> torch.Tensor:
    """x [..., D] (D % 16 == 0) -> uint8 [..., D/2 + D/16]: packed codes, then E4M3 block scales.
    ``gscale``: the second-level float32 scale (0: stores zeros); ``rule``: ``scale_rule``'s."""
    *lead, D = x.shape
    xb = x.float().reshape(*lead, D // FP4_BLOCK, FP4_BLOCK)
    bs8, code = block_scales(xb, gscale.float(), rule)
    code = code.reshape(*lead, D)
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
