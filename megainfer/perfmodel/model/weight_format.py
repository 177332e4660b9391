"""Bytes per weight of each ``model.quantization``, as the loader keeps them
(``megainfer/models/quant_weights.py``, ``kernels/weight_quant.py``), per stored weight of a
matrix with K input columns:

* ``None`` / ``fp8_dequant``: the model dtype's bytes (``None`` on a checkpoint that ships FP8
  weights is that checkpoint's ``fp8``: ``checkpoint_quantization``);
* ``fp8``: 1 byte + one float32 scale per 128 x 128 block, 4 / 16384;
* ``int8``: 1 byte + one model-dtype scale per output row, dtype_bytes / K (K = hidden size);
* ``int4``: 1/2 byte + a (scale, zero) pair per group of G inputs, 2 * dtype / G.
Only the quantised weights use these bytes; the rest stay in the model dtype.
docs/perfmodel.md, "Weight formats".
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Optional

from megainfer.config import ConfigError

FP8_BLOCK_WEIGHTS = 128 * 128  # weights per float32 block scale
FP8_SCALE_BYTES = 4


def bytes_per_weight(quantization: Optional[str], dtype_b: float, k: int,
                     group_size: int = 64) -> float:
    """Stored bytes of one weight of a quantised matrix with ``k`` inputs, scales included;
    ``dtype_b``: the model dtype's bytes."""
    if quantization in (None, "fp8_dequant"):
        return float(dtype_b)
    if quantization == "fp8":
        return 1.0 + FP8_SCALE_BYTES / FP8_BLOCK_WEIGHTS
    if quantization == "int8":
        return 1.0 + dtype_b / k
    if quantization == "int4":
        return 0.5 + 2.0 * dtype_b / group_size
    raise ConfigError(f"model.quantization={quantization!r}: unknown")


def checkpoint_quantization(path: str) -> Optional[str]:
    """The format a checkpoint ships its weights in: ``fp8`` when its config.json has an fp8
    ``quantization_config`` (DeepSeek-V3, Qwen3-*-FP8), else None (the model dtype)."""
    fn = os.path.join(os.path.expanduser(path), "config.json")
    try:
        with open(fn) as f:
            q = (json.load(f) or {}).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # the shape reader reports an unreadable config.json
    return "fp8" if isinstance(q, dict) and q.get("quant_method") == "fp8" else None


def with_weight_format(shape, quantization: Optional[str], group_size: int = 64,
                       path: Optional[str] = None):
    """``shape`` (a ModelShape) in the weight format a job keeps: ``model.quantization``, or
    with null the checkpoint's own (``path``: an FP8 checkpoint stays FP8)."""
    if quantization is None and path:
        quantization = checkpoint_quantization(path)
    return replace(shape, quantization=quantization, quantization_group_size=group_size)
