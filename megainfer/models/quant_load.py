"""Checkpoint tensors -> weights kept in a stored format (``quant_weights.py``), one tensor at
a time: never a full-precision copy of the model.

A float8 tensor whose dtype and block match the format is read as it is (its fp8 bytes and
``weight_scale_inv`` rows go into the parameters unchanged); anything else is read as float32
(this rank's rows), quantised, and the float32 copy dropped: peak extra memory is one tensor in
float32. Tensor-parallel slices of dim 0 read only their rows (fp8 on whole blocks); slices of
dim 1 (row-parallel ``o_proj``) are quantised whole, then sliced, so every rank stores exactly
single mode's bytes and scales.
docs/checkpoints.md, "Weight formats" (Loading).
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from megainfer.config import ConfigError
from megainfer.kernels.weight_quant import (WeightFormat, cdiv, pack_int4, quantize,
                                            quantize_int4_values)

from .checkpoint_reader import CheckpointReader
from .moe import RoutedExperts

log = logging.getLogger("megainfer.models")


def _as_stored(reader: CheckpointReader, name: str, fmt: WeightFormat) -> bool:
    """The checkpoint holds ``name`` in ``fmt`` itself (float8 of the same dtype and block)."""
    got = reader.stored_format(name)
    return got is not None and fmt.name == "fp8" and got == (fmt.fp8_dtype, tuple(fmt.block))


def _read_float(reader: CheckpointReader, name: str, rows=None) -> torch.Tensor:
    """The logical values (float8 dequantised) of ``name`` or rows of its dim 0, float32."""
    shape = list(reader.shape(name))
    if rows is not None:
        shape[0] = rows[1] - rows[0]
    out = torch.empty(shape, dtype=torch.float32)
    reader.read(name, out, rows=rows)
    return out


def _slice_cols(data, scale, fmt: WeightFormat, c0: int, c1: int):
    """Stored (data, scale) of a [..., N, K] weight -> those of its input columns [c0, c1)
    (fp8: on block edges; int8: the per-row scale is the whole row's)."""
    if fmt.name == "int8":
        return data[..., c0:c1].contiguous(), scale
    bi = fmt.block[1]
    return (data[..., c0:c1].contiguous(),
            scale[..., c0 // bi:cdiv(c1, bi)].contiguous())


def stored_tensors(reader: CheckpointReader, name: str, fmt: WeightFormat,
                   scale_dtype: torch.dtype, shard: Optional[tuple] = None,
                   rows: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale) of checkpoint tensor ``name`` in ``fmt`` on the host: this rank's
    ``shard`` (nn.Linear's ``tp_shard``: dim, slice, full) of a 2-D weight, or ``rows`` of
    dim 0 of a fused [E, N, K] expert tensor (one expert: rows (e, e + 1))."""
    cols = None
    if shard is not None:
        dim, sl, _ = shard
        if dim == 0:
            rows = (sl.start, sl.stop)
        else:
            cols = (sl.start, sl.stop)
    if _as_stored(reader, name, fmt):
        data, scale = reader.read_stored(name, rows)
        if rows is not None and len(data.shape) == 2 and rows[0] % fmt.block[0]:
            raise ConfigError(f"tensor {name!r}: rows from {rows[0]} are not on a whole "
                              f"{fmt.block[0]}-row block of model.quantization=fp8")
        return (data, scale) if cols is None else _slice_cols(data, scale, fmt, *cols)
    return _quantise(_read_float(reader, name, rows), fmt, scale_dtype, cols)


def _quantise(w: torch.Tensor, fmt: WeightFormat, scale_dtype: torch.dtype,
              cols: Optional[tuple[int, int]] = None):
    """w [..., N, K] float32 -> stored (data, scale), or those of its input columns
    [c0, c1) of the whole tensor's quantisation (int4: group values sliced, then packed)."""
    if cols is None:
        return quantize(w, fmt, scale_dtype)
    if fmt.name == "int4":
        q, sz = quantize_int4_values(w, fmt.group_size, scale_dtype)
        G = fmt.group_size
        return (pack_int4(q[:, cols[0]:cols[1]], fmt.int4_layout),
                sz[cols[0] // G:cols[1] // G].contiguous())
    return _slice_cols(*quantize(w, fmt, scale_dtype), fmt, *cols)


def load_quant_linear(reader: CheckpointReader, name: str, mod) -> None:
    """A ``QuantLinear``'s weight and scale <- checkpoint tensor ``name`` (its bias, if any,
    is an ordinary parameter the loader reads itself)."""
    data, scale = stored_tensors(reader, name, mod.fmt, mod.scale.dtype, mod.shard)
    _copy(mod.weight, data, name)
    _copy(mod.scale, scale, name)


def load_quant_expert(reader: CheckpointReader, ex, local: int, e: int, src: tuple) -> None:
    """Local slot ``local`` of quantised ``ex`` <- logical expert ``e`` from ``src`` (the
    loader's ``_expert_source``): row e of fused [E, N, K] tensors ('fused', gate_up, down), or
    per-expert tensors ('split', gate, up, down), gate and up stacked along N. Stored fp8
    halves are joined as they are, which needs whole blocks per half (checked before loading:
    ``check_stored_experts``)."""
    if src[0] == "fused":
        for part, name in zip(("gate_up_proj", "down_proj"), src[1:]):
            _put_expert(ex, local, part, *stored_tensors(
                reader, name, ex.weight_format, _sdt(ex, part), rows=(e, e + 1)), squeeze=True)
        return
    parts = dict(zip(("gate", "up", "down"), src[1:]))
    fmt, names = ex.weight_format, [parts["gate"], parts["up"]]
    if all(_as_stored(reader, n, fmt) for n in names):  # block grid checked before loading
        halves = [reader.read_stored(n) for n in names]
        data, scale = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    else:
        w = torch.cat([_read_float(reader, n) for n in names])  # [2N, K] float32
        data, scale = _quantise(w, fmt, _sdt(ex, "gate_up_proj"))
        del w
    _put_expert(ex, local, "gate_up_proj", data, scale)
    _put_expert(ex, local, "down_proj",
                *stored_tensors(reader, parts["down"], fmt, _sdt(ex, "down_proj")))


def check_stored_experts(where, model, N: int) -> None:
    """Before any weight is read: per-expert gate and up kept as stored fp8 join into one
    [2N, K] weight whose blocks are the halves' only when N is a whole number of blocks."""
    fmt = next((m.weight_format for m in model.modules()
                if isinstance(m, RoutedExperts) and m.quantised), None)
    scales = getattr(where, "scales", {})
    quant = getattr(where, "quant", None)
    if fmt is None or fmt.name != "fp8" or quant is None or N % fmt.block[0] == 0:
        return
    per_expert = sorted(n for n in scales if ".experts." in n and n.endswith(".weight"))
    if per_expert and (quant.dtype, tuple(quant.block)) == (fmt.fp8_dtype, tuple(fmt.block)):
        raise ConfigError(
            f"model.quantization (null or fp8) keeps the checkpoint's fp8 blocks, but expert "
            f"tensors such as {per_expert[0]!r} have moe_intermediate_size={N} rows, not a "
            f"multiple of the {fmt.block[0]}-row weight_block_size, so gate and up cannot share "
            "one block grid; use model.quantization=fp8_dequant (or int8)")


def _sdt(ex, part: str) -> torch.dtype:
    return getattr(ex, part + ex.weight_format.scale_name).dtype


def _put_expert(ex, local: int, part: str, data, scale, squeeze: bool = False) -> None:
    if squeeze:  # one row of a fused [E, ...] tensor
        data, scale = data[0], scale[0]
    _copy(getattr(ex, part)[local], data, f"{part}[{local}]")
    _copy(getattr(ex, part + ex.weight_format.scale_name)[local], scale, f"{part}[{local}]")


def quantised_dummy(mod, w: torch.Tensor, local: Optional[int] = None,
                    part: Optional[str] = None) -> None:
    """Dummy weights: the full float32 tensor ``w`` quantised into a ``QuantLinear`` (this
    rank's slice of it) or into slot ``local`` of quantised experts' ``part``."""
    if part is not None:
        _put_expert(mod, local, part, *_quantise(w, mod.weight_format, _sdt(mod, part)))
        return
    shard, cols = mod.shard, None
    if shard is not None and shard[0] == 0:
        w = w[shard[1]]
    elif shard is not None:
        cols = (shard[1].start, shard[1].stop)
    data, scale = _quantise(w, mod.fmt, mod.scale.dtype, cols)
    _copy(mod.weight, data, "dummy")
    _copy(mod.scale, scale, "dummy")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ConfigError(f"tensor {name!r}: stored shape {list(src.shape)} does not fit "
                          f"parameter of shape {list(dst.shape)}")
    dst.data.copy_(src.to(device=dst.device, dtype=dst.dtype) if src.dtype != dst.dtype
                   or src.device != dst.device else src)


def report_bytes(model, role: str, fmt: Optional[WeightFormat], dtype: torch.dtype) -> dict:
    """Log (and return) the bytes this rank's weights take, split into those kept in ``fmt``
    (with their scales) and the rest (model dtype): the start-up line per role."""
    b = weight_bytes_by_kind(model)
    dt = str(dtype).replace("torch.", "")
    total = (b["quantised"] + b["other"]) / 2**20
    if fmt is None:
        log.info("weights (%s role): %.2f MiB in %s", role, total, dt)
    else:
        log.info("weights (%s role): %.2f MiB = %.2f MiB linear/expert weights in %s (with "
                 "scales) + %.2f MiB in %s (embeddings, lm_head, norms, routers, kv_b_proj)",
                 role, total, b["quantised"] / 2**20, fmt.name, b["other"] / 2**20, dt)
    return b


def weight_bytes_by_kind(model) -> dict:
    """{'quantised': bytes of stored weights and scales, 'other': the rest} of a built model."""
    from .quant_weights import is_quantised
    seen, out = set(), {"quantised": 0, "other": 0}
    quant_ids = set()
    for mod in model.modules():
        if is_quantised(mod):
            for n, p in mod.named_parameters(recurse=False):
                if n != "bias":
                    quant_ids.add(id(p))
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out["quantised" if id(p) in quant_ids else "other"] += math.prod(p.shape) * p.element_size()
    return out
