"""What the Triton paged-attention kernels accept, as one line a user can act on (no Triton
import: the limits live with the torch references in ``attention_ref``).

The engine asks this at start-up (``DeviceConfig.check_model``) so that a model the kernels
cannot run is refused with a ``ConfigError`` before any weight is loaded.
"""
from __future__ import annotations

from typing import Optional

from .attention_ref import DTYPES as _DTYPES
from .attention_ref import MAX_HEAD_DIM

DTYPES = tuple(str(d).removeprefix("torch.") for d in _DTYPES)  # float32, bfloat16, float16


def attention_limits_error(head_dim: int, num_heads: int, num_kv_heads: int,
                           dtype: str) -> Optional[str]:
    """None when the kernels take this shape and dtype, else why not (one line)."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"the Triton attention kernels take head_dim 1..{MAX_HEAD_DIM}, this model has {head_dim}"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    if dtype not in DTYPES:
        return f"the Triton attention kernels take {', '.join(DTYPES)}, not {dtype}"
    return None


def kv_cache_limits_error(kv_cache_dtype: str, is_mla: bool = False) -> Optional[str]:
    """None when attention_backend=triton reads a cache in ``kv_cache_dtype``: the GQA kernels
    read auto, float8 and fp4_e2m1 (kernels/kv_quant.py); MLA layers read float8 in the decode
    kernel and fp4 through the torch decode. Kept as the one place a future format that the
    kernels cannot read is refused (never run at full precision instead)."""
    from .kv_quant import FORMATS
    if kv_cache_dtype not in FORMATS:
        return f"the Triton attention kernels read {', '.join(FORMATS)}, not {kv_cache_dtype}"
    return None
