"""What every config module shares: the error type, its one check and the predicates it is
given, the fixed vocabularies."""
from __future__ import annotations

import math

SUPPORTED_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3")
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("torch", "triton")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# model.quantization (docs/checkpoints.md, "Weight formats"); None: the checkpoint's own format
QUANTIZATIONS = (None, "fp8", "int8", "int4", "fp8_dequant")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 weight-only GEMM takes


def torch_dtype_of(name: str):
    """A ``DTYPE_NAMES`` entry (``model.dtype``, a profile's dtype) -> its torch dtype."""
    require(name in DTYPE_NAMES, "dtype", name, f"must be one of {', '.join(DTYPE_NAMES)}")
    import torch
    return getattr(torch, name)


class ConfigError(ValueError):
    """A config field has a bad value; the message names the field."""


def require(ok: bool, name: str, value, why: str) -> None:
    """ConfigError ``name=value: why`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name}={value!r}: {why}")


def is_int_at_least(v, lo: int) -> bool:
    """An int (not a bool) >= ``lo``."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def is_number(v, finite: bool = True) -> bool:
    """An int or float (not a bool), never NaN; ``finite=False`` lets ±inf through."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
        return False
    return not finite or math.isfinite(v)


def check_weight_format(quantization, group_size) -> None:
    """``model.quantization`` and ``model.quantization_group_size`` (``ConfigError`` naming
    the key): the loader's ``LoadConfig`` and the planner's ``ModelShape`` alike."""
    require(quantization in QUANTIZATIONS, "model.quantization", quantization,
            "must be null, " + ", ".join(q for q in QUANTIZATIONS if q))
    require(is_int_at_least(group_size, 1) and group_size in INT4_GROUP_SIZES,
            "model.quantization_group_size", group_size,
            f"must be one of {', '.join(map(str, INT4_GROUP_SIZES))}")
