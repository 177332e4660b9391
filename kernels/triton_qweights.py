"""Triton tile helpers for weights kept in a stored format (``weight_quant.py``): a weight tile
dequantised in registers, and DeepSeek's per-token-group fp8 activation quantisation of an
activation tile. ``triton_moe``'s grouped GEMMs call them (``FMT`` constexpr).

Formats (``FMT``): 0 plain (the weight's own dtype), 1 int8 (``data [N, K]`` int8, ``scale
[N]``), 2 int4 (canonical nibbles: ``data [N, K/2]`` uint8, low nibble = even k, and
``scale_zeros [K/G, N, 2]``: ``W = (q - 8) * scale + zero``), 3 fp8 (``data [N, K]`` float8,
``scale_inv [ceil(N/BO), ceil(K/BI)]``). The int4 layout here is not torch's CPU one:
``weight_quant.pack_int4_canonical`` writes it.
"""
import torch
import triton
import triton.language as tl

FMT_IDS = {None: 0, "int8": 1, "int4": 2, "fp8": 3}
# fp8 activation grid per format: (mantissa bits, smallest normal exponent, largest value)
FP8_GRID = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}


@triton.jit
def load_weight_tile(w_base, s_base, offs_n, offs_k, mask, s_wn, s_wk, s_sa, s_sb,
                     FMT: tl.constexpr, G: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    """W[offs_n, offs_k] as a [BK, BN] tile (K down, N across), fp32 for a stored format.
    ``w_base``/``s_base``: this expert's data and scale; ``s_sa``/``s_sb``: the scale's strides
    (int8: over N; int4: over groups, over N; fp8: over N blocks, over K blocks)."""
    if FMT == 0:
        return tl.load(w_base + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk, mask=mask,
                       other=0.0)
    if FMT == 1:
        q = tl.load(w_base + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk, mask=mask, other=0)
        s = tl.load(s_base + offs_n[None, :] * s_sa, mask=mask, other=0.0)
        return q.to(tl.float32) * s.to(tl.float32)
    if FMT == 2:
        byte = tl.load(w_base + offs_n[None, :] * s_wn + (offs_k // 2)[:, None] * s_wk,
                       mask=mask, other=0).to(tl.int32)
        q = (byte >> ((offs_k % 2) * 4)[:, None]) & 15
        sz = s_base + (offs_k // G)[:, None] * s_sa + offs_n[None, :] * s_sb
        s = tl.load(sz, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(sz + 1, mask=mask, other=0.0).to(tl.float32)
        return (q.to(tl.float32) - 8.0) * s + z
    q = tl.load(w_base + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk, mask=mask, other=0.0)
    s = tl.load(s_base + (offs_n // BO)[None, :] * s_sa + (offs_k // BI)[:, None] * s_sb,
                mask=mask, other=0.0)
    return q.to(tl.float32) * s


@triton.jit
def fp8_round(v, MANT: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    """v (fp32, |v| <= FMAX) rounded to the nearest float8 value (ties to even), in fp32
    arithmetic: the step of v's binade (subnormals: of the smallest), then round-half-even by
    the 1.5 * 2**23 shift. The interpreter's float8 casts round wrongly at binade edges."""
    a = tl.abs(v)
    e = tl.floor(tl.log2(tl.maximum(a, 1e-30)))
    e = tl.maximum(e, EMIN)
    step = tl.exp2(e - MANT)
    t = v / step
    r = (t + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(r * step, -FMAX), FMAX)


@triton.jit
def quant_act_tile(a, MANT: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    """a [BM, BK] (one BK-wide group per row) -> the values an fp8 GEMM sees: per row,
    scale = max(amax / FMAX, 1e-12), fp8(a / scale) * scale (``weight_quant.quantize_act_fp8``
    with group = BK)."""
    af = a.to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(af), axis=1) / FMAX, 1e-12)  # [BM]
    return fp8_round(af / s[:, None], MANT, EMIN, FMAX) * s[:, None]
