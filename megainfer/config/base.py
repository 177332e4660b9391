"""What every config module shares: the error type, its one check, the fixed vocabularies."""
from __future__ import annotations

SUPPORTED_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3")
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("torch", "triton")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


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
