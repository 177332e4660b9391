"""Weight formats a linear or expert weight is kept in (``model.quantization``): their
quantisers and torch reference dequantisers (compute paths: ``cpu_qgemm.py``).

A logical weight ``W [..., N, K]`` (N output rows, K input columns; leading dims: experts):
``fp8`` e4m3/e5m2 ``data [..., N, K]`` + float32 ``scale_inv [..., ceil(N/bo), ceil(K/bi)]``,
``W = data * scale_inv[i // bo, j // bi]``; ``int8`` ``data [..., N, K]`` + ``scale [..., N]``,
``W = data * scale[i]``; ``int4`` uint8 ``data [..., N, K/2]`` (torch's CPU int4 layout) +
``scale_zeros [..., K/G, N, 2]``, ``W = (q - 8) * scale + zero``, N % 16 == 0, K % G == 0.
int8/int4 scales are in the model dtype. ``QuantizedWeight`` bundles one weight's stored
tensors (by reference) with its format and logical shape; indexing it by expert gives one's.
docs/checkpoints.md, "Weight formats".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FORMATS = ("fp8", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_LAYOUTS = ("torch_cpu", "nibbles")
FP8_BLOCK = (128, 128)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WeightFormat:
    """How weights are stored: ``name`` in FORMATS; ``block`` (fp8: rows, cols of a scale
    block); ``group_size`` (int4: input columns per scale); ``fp8_dtype`` (fp8 only)."""

    name: str
    block: tuple = FP8_BLOCK
    group_size: int = 64
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    int4_layout: str = "torch_cpu"  # torch_cpu (aten's CPU op) | nibbles (the Triton kernels)

    def __post_init__(self):
        if self.name not in FORMATS:
            raise ValueError(f"weight format {self.name!r}: must be one of {FORMATS}")
        if self.int4_layout not in INT4_LAYOUTS:
            raise ValueError(f"int4_layout={self.int4_layout!r}: must be one of {INT4_LAYOUTS}")
        if self.name == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group_size={self.group_size}: must be one of "
                             f"{INT4_GROUP_SIZES}")

    @property
    def storage_dtype(self) -> torch.dtype:
        return {"fp8": self.fp8_dtype, "int8": torch.int8, "int4": torch.uint8}[self.name]

    @property
    def scale_name(self) -> str:
        """The suffix of the scale parameter beside ``weight`` (HF's for fp8)."""
        return {"fp8": "_scale_inv", "int8": "_scale", "int4": "_scale_zeros"}[self.name]

    def storage_shape(self, lead: tuple, N: int, K: int) -> tuple:
        return tuple(lead) + ((N, K // 2) if self.name == "int4" else (N, K))

    def scale_shape(self, lead: tuple, N: int, K: int) -> tuple:
        if self.name == "fp8":
            return tuple(lead) + (cdiv(N, self.block[0]), cdiv(K, self.block[1]))
        if self.name == "int8":
            return tuple(lead) + (N,)
        return tuple(lead) + (K // self.group_size, N, 2)

    def shape_error(self, N: int, K: int) -> Optional[str]:
        """Why a [N, K] weight cannot be stored in this format, or None."""
        if self.name == "int4":
            G = self.group_size
            if K % G:
                return f"in_features={K} is not a multiple of model.quantization_group_size={G}"
            if N % 16 and self.int4_layout == "torch_cpu":
                return f"out_features={N} is not a multiple of 16 (torch's CPU int4 layout)"
        return None

    def scale_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """fp8 block scales stay float32 (as shipped); int8/int4 scales are the model dtype."""
        return torch.float32 if self.name == "fp8" else model_dtype

    def nbytes(self, lead: tuple, N: int, K: int, model_dtype=torch.float32) -> int:
        """Stored bytes of one [*lead, N, K] weight with its scales."""
        n = 1
        for d in self.storage_shape(lead, N, K):
            n *= d
        s = 1
        for d in self.scale_shape(lead, N, K):
            s *= d
        return n * self.storage_dtype.itemsize + self.scale_dtype(model_dtype).itemsize * s


@dataclass
class QuantizedWeight:
    """One stored weight: ``data`` and ``scale`` (the module's parameters), its ``fmt`` and
    logical ``shape`` [..., N, K]. ``qw[e]``: expert e's weight of a stacked [E, N, K] one."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: WeightFormat
    shape: tuple

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, e: int) -> "QuantizedWeight":
        return QuantizedWeight(self.data[e], self.scale[e], self.fmt, tuple(self.shape[1:]))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical weight in ``dtype`` (reference; the compute paths never store it)."""
        return dequantize(self, dtype)


# ----------------------------------------------------------------------------- quantisers
def quantize_fp8(w: torch.Tensor, block=FP8_BLOCK, dtype=torch.float8_e4m3fn):
    """w [..., N, K] float -> (data [..., N, K] float8, scale_inv [..., ceil(N/bo), ceil(K/bi)]
    float32), scale_inv = block amax / fp8 max (edge blocks partial)."""
    w = w.float()
    bo, bi = block
    fmax = FP8_MAX[dtype]
    *lead, N, K = w.shape
    nr, nc = cdiv(N, bo), cdiv(K, bi)
    pad = w.new_zeros(*lead, nr * bo, nc * bi, dtype=torch.float32)
    pad[..., :N, :K] = w
    blocks = pad.unflatten(-1, (nc, bi)).unflatten(-3, (nr, bo))  # [..., nr, bo, nc, bi]
    scale = (blocks.abs().amax(dim=(-3, -1)) / fmax).clamp_min(1e-12)  # [..., nr, nc]
    q = (blocks / scale[..., :, None, :, None]).clamp(-fmax, fmax).to(dtype)
    q = q.flatten(-2, -1).flatten(-3, -2)[..., :N, :K].contiguous()
    return q, scale.contiguous()


def quantize_int8(w: torch.Tensor, scale_dtype=torch.float32):
    """w [..., N, K] float -> (data int8 [..., N, K], scale [..., N] in ``scale_dtype``):
    symmetric per output channel, scale = row amax / 127 rounded to ``scale_dtype`` first (the
    CPU op takes scales in the activations' dtype), values rounded against that scale."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1) / 127.0).clamp_min(1e-12).to(scale_dtype)  # [..., N]
    q = torch.round(wf / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4_values(w: torch.Tensor, group_size: int, scale_dtype=torch.float32):
    """w [N, K] float -> (q int32 [N, K] in [0, 15], scale_zeros [K/G, N, 2] in
    ``scale_dtype``): asymmetric per group of G columns, scale = (max - min) / 15 and zero =
    min + 8 * scale, both rounded to ``scale_dtype``, so ``W = (q - 8) * scale + zero``
    (torch's CPU int4 convention), q rounded against the stored scale and zero."""
    N, K = w.shape
    G = group_size
    wg = w.float().view(N, K // G, G)
    mn, mx = wg.amin(-1), wg.amax(-1)  # [N, K/G]
    scale = ((mx - mn) / 15.0).clamp_min(1e-12).to(scale_dtype).float()
    zero = (mn + 8.0 * scale).to(scale_dtype).float()
    q = torch.round((wg - zero[..., None]) / scale[..., None] + 8.0).clamp_(0, 15)
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(scale_dtype).contiguous()  # [K/G, N, 2]
    return q.to(torch.int32).view(N, K), sz


def pack_int4(q: torch.Tensor, layout: str = "torch_cpu") -> torch.Tensor:
    """q int32 [N, K] in [0, 15] -> uint8 [N, K/2]: torch's CPU int4 layout (rows tiled by
    16), or ``nibbles`` (byte j of a row holds k = 2j in its low and 2j + 1 in its high half)."""
    if layout == "nibbles":
        q = q.to(torch.uint8)
        return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the ``nibbles`` layout -> q int32 [N, K]."""
    lo, hi = (data & 15).to(torch.int32), (data >> 4).to(torch.int32)
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int, scale_dtype=torch.float32,
                  layout: str = "torch_cpu"):
    """w [..., N, K] float -> (data uint8 [..., N, K/2], scale_zeros [..., K/G, N, 2])."""
    if w.dim() > 2:
        parts = [quantize_int4(x, group_size, scale_dtype, layout) for x in w]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    q, sz = quantize_int4_values(w.cpu(), group_size, scale_dtype)
    return pack_int4(q, layout).to(w.device), sz.to(w.device)


def quantize(w: torch.Tensor, fmt: WeightFormat, scale_dtype=torch.float32):
    """w [..., N, K] float -> (data, scale) stored in ``fmt``; int8/int4 scales in
    ``scale_dtype`` (the model dtype: what the CPU ops take), fp8's float32."""
    if fmt.name == "fp8":
        return quantize_fp8(w, fmt.block, fmt.fp8_dtype)
    if fmt.name == "int8":
        return quantize_int8(w, scale_dtype)
    return quantize_int4(w, fmt.group_size, scale_dtype, fmt.int4_layout)


# ----------------------------------------------------------------------------- references
def dequantize_int4_values(q: torch.Tensor, sz: torch.Tensor, group_size: int,
                           dtype=torch.float32) -> torch.Tensor:
    """q [N, K] in [0, 15], scale_zeros [K/G, N, 2] -> W [N, K] = (q - 8) * scale + zero."""
    N, K = q.shape
    s = sz[..., 0].t().repeat_interleave(group_size, dim=1)  # [N, K]
    z = sz[..., 1].t().repeat_interleave(group_size, dim=1)
    return ((q.float() - 8.0) * s + z).to(dtype)


def dequantize(qw: QuantizedWeight, dtype=torch.float32) -> torch.Tensor:
    """The logical weight [..., N, K] of ``qw`` in ``dtype``, element by element from the
    stored tensors (int4: through the CPU op on an identity, which reads one weight per
    output, exactly)."""
    fmt, N, K = qw.fmt, qw.shape[-2], qw.shape[-1]
    if len(qw.shape) > 2:
        return torch.stack([dequantize(qw[e], dtype) for e in range(qw.shape[0])])
    if fmt.name == "fp8":
        bo, bi = fmt.block
        s = qw.scale.float().repeat_interleave(bo, 0)[:N].repeat_interleave(bi, 1)[:, :K]
        return (qw.data.float() * s).to(dtype)
    if fmt.name == "int8":
        return (qw.data.float() * qw.scale.float()[:, None]).to(dtype)
    if fmt.int4_layout == "nibbles":
        return dequantize_int4_values(unpack_nibbles(qw.data), qw.scale.float(),
                                      fmt.group_size, dtype)
    eye = torch.eye(K, dtype=torch.float32, device=qw.data.device)
    w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, qw.data, fmt.group_size,
                                                     qw.scale.float().contiguous())  # [K, N]
    return w_t.t().to(dtype).contiguous()


def quantize_act_fp8_scaled(x: torch.Tensor, group: int, dtype=torch.float8_e4m3fn):
    """Dynamic per-token-group activation quantisation, as DeepSeek-V3 runs it: x [T, K] ->
    (q [T, K] ``dtype``, s [T, ceil(K/group)] float32), s = max(group amax / fp8 max, 1e-12),
    q = fp8(x / s) (the operands of a w8a8 block GEMM)."""
    T, K = x.shape
    fmax = FP8_MAX[dtype]
    nc = cdiv(K, group)
    pad = x.new_zeros(T, nc * group, dtype=torch.float32)
    pad[:, :K] = x
    g = pad.view(T, nc, group)
    s = (g.abs().amax(-1, keepdim=True) / fmax).clamp_min(1e-12)  # [T, nc, 1]
    q = (g / s).clamp_(-fmax, fmax).to(dtype)
    return q.view(T, nc * group)[:, :K].contiguous(), s[..., 0].contiguous()


def quantize_act_fp8(x: torch.Tensor, group: int, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """``quantize_act_fp8_scaled`` returned dequantised in x's dtype: x [T, K] -> [T, K]
    holding the values an fp8 GEMM sees."""
    q, s = quantize_act_fp8_scaled(x, group, dtype)
    return (q.float() * s.repeat_interleave(group, dim=1)[:, :x.shape[1]]).to(x.dtype)


def qlinear_ref(x: torch.Tensor, qw: QuantizedWeight,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias) -> [T, N] in float32 from the dequantised weight (fp8: on the
    per-token-group quantised activations): what every compute path must match."""
    xf = x.float()
    if qw.fmt.name == "fp8":
        xf = quantize_act_fp8(xf, qw.fmt.block[1], qw.fmt.fp8_dtype)
    y = xf @ dequantize(qw).t()
    return y if bias is None else y + bias.float()
