"""FP8 block-quantised checkpoints (the DeepSeek-V3 / HF ``quant_method: fp8`` layout),
dequantised on load.

A quantised linear weight ``X.weight [out, in]`` is float8 (``F8_E4M3`` or ``F8_E5M2``) beside
a float ``X.weight_scale_inv [ceil(out/bo), ceil(in/bi)]``, ``(bo, bi)`` the
``weight_block_size``: value ``fp8.float() * scale_inv[i // bo, j // bi]`` (edge blocks may be
partial); fused experts ``mlp.experts.gate_up_proj [E, out, in]`` have a 3-D scale likewise.
``checkpoint_reader`` hides the scales from the names the loader iterates and delivers the
dequantised values (float32 arithmetic, one cast). Errors: the loader's ``CheckpointError``
subclasses naming tensor and file; a bad ``quantization_config`` is a ``ConfigError``.
docs/checkpoints.md, "FP8 block-quantised checkpoints".
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from megainfer.config import ConfigError
from megainfer.kernels.cpu_qgemm import dequantize_fp8_blocks
from megainfer.kernels.weight_quant import cdiv

from .checkpoint_errors import CorruptCheckpointError, ShapeMismatchError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv; fused X.gate_up_proj -> ..._scale_inv


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def weight_name(scale: str) -> str:
    return scale[:-len(SCALE_SUFFIX)]


@dataclass(frozen=True)
class QuantConfig:
    """config.json ``quantization_config`` of a block-quantised fp8 checkpoint."""

    fmt: str  # e4m3 | e5m2
    block: tuple  # (rows, cols) of one scale block: weight_block_size
    activation_scheme: str = "dynamic"

    @property
    def dtype(self) -> torch.dtype:
        return FMTS[self.fmt]

    @classmethod
    def from_hf(cls, cfg: dict) -> Optional["QuantConfig"]:
        """From a whole HF config dict; None when it has no ``quantization_config``."""
        q = cfg.get("quantization_config")
        if q is None:
            return None
        key = "config.json quantization_config"
        if not isinstance(q, dict):
            raise ConfigError(f"{key}={q!r}: must be an object")
        method = q.get("quant_method")
        if method != "fp8":
            raise ConfigError(f"{key}.quant_method={method!r}: unsupported; only 'fp8' "
                              "(block-quantised float8 weights) is loaded")
        fmt = q.get("fmt", "e4m3")
        if fmt not in FMTS:
            raise ConfigError(f"{key}.fmt={fmt!r}: must be one of {', '.join(FMTS)}")
        act = q.get("activation_scheme", "dynamic")
        if act != "dynamic":
            raise ConfigError(f"{key}.activation_scheme={act!r}: only 'dynamic' is supported "
                              "(weights are dequantised on load; no activation scales)")
        block = q.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                           for b in block)):
            raise ConfigError(f"{key}.weight_block_size={block!r}: must be two positive "
                              "integers [rows, cols]")
        return cls(fmt=fmt, block=tuple(block), activation_scheme=act)

    @classmethod
    def from_pretrained(cls, path: str) -> Optional["QuantConfig"]:
        """From ``path/config.json``; None when there is no such file or no quantization."""
        fn = os.path.join(path, "config.json")
        if not os.path.isfile(fn):
            return None
        try:
            with open(fn) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path={path!r}: cannot read config.json ({e})") from e
        if not isinstance(cfg, dict):
            raise ConfigError(f"model.path={path!r}: config.json is not a JSON object")
        return cls.from_hf(cfg)


def expected_scale_shape(shape, block, row0: int = 0) -> tuple:
    """The scale's shape for a weight (or a dim -2 slice of it starting at row ``row0`` of the
    full weight): leading dims as they are, then the blocks the last two dims touch."""
    bo, bi = block
    rows, cols = shape[-2], shape[-1]
    return tuple(shape[:-2]) + (cdiv(row0 + rows, bo) - row0 // bo, cdiv(cols, bi))


def check_scale_shape(name: str, wshape, sshape, block, where: str = "", row0: int = 0,
                      sname: Optional[str] = None) -> None:
    """ShapeMismatchError naming the weight (and its scale) unless the scale fits the weight."""
    loc = f" in {where}" if where else ""
    sname = sname or scale_name(name)
    if len(wshape) < 2:
        raise ShapeMismatchError(f"tensor {name!r}{loc}: float8 weight of shape {list(wshape)}; "
                                 "block quantisation needs at least 2 dims")
    want = expected_scale_shape(wshape, block, row0)
    if tuple(sshape) != want:
        raise ShapeMismatchError(
            f"tensor {sname!r}{loc}: block scale of shape {list(sshape)} does not fit weight "
            f"{name!r} of shape {list(wshape)} with weight_block_size {list(block)} "
            f"(expects {list(want)})")


def check_scale_values(sname: str, scale: torch.Tensor, where: str = "") -> None:
    """CorruptCheckpointError naming the scale if any value is NaN, infinite or <= 0."""
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        loc = f" in {where}" if where else ""
        raise CorruptCheckpointError(
            f"tensor {sname!r}{loc}: {int(bad.sum())} block scale value(s) not finite and "
            f"positive (first at block {idx}: {float(scale[tuple(idx)])})")


def dequantize_blockwise(w: torch.Tensor, scale_inv: torch.Tensor, block,
                         dtype: torch.dtype = torch.float32, *, row0: int = 0,
                         name: str = "weight") -> torch.Tensor:
    """``w [..., out, in]`` (float8) times its block scales, computed in float32 and cast once
    to ``dtype``. ``scale_inv [..., ceil(out/bo), ceil(in/bi)]``; edge blocks may be partial.
    ``row0``: ``w`` holds rows ``[row0, row0 + out)`` of dim -2 of the full weight and
    ``scale_inv`` the block rows they touch (``row0 // bo`` on), so a slice that does not start
    on a block boundary is scaled like the full tensor. No full-size scale is materialised: the
    float32 copy of ``w`` is multiplied in place, block row by block row in one broadcast
    (``kernels.cpu_qgemm.dequantize_fp8_blocks``, after the scale's shape is checked)."""
    check_scale_shape(name, tuple(w.shape), tuple(scale_inv.shape), tuple(block), row0=row0)
    return dequantize_fp8_blocks(w, scale_inv, block, dtype, row0=row0)
