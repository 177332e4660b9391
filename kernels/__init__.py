"""MoE kernels (installed as ``megainfer.kernels``): each fast path has a pure-torch reference.

Dispatch: CUDA tensors go to the Triton kernels, CPU tensors to the vectorised torch path.
``backend="triton"`` forces Triton (on CPU only under ``TRITON_INTERPRET=1``, for tests).
Triton modules are imported lazily, so importing this package never needs a GPU.
"""
from .entry_points import fused_moe, moe_align, select_experts
from .reference import RoutingError, fused_moe_ref, moe_align_ref, select_experts_ref
from .torch_moe import fused_moe_torch

__all__ = ["fused_moe", "select_experts", "moe_align", "fused_moe_ref", "select_experts_ref",
           "moe_align_ref", "fused_moe_torch", "RoutingError"]

# Paged attention: torch references and argument checks here; the Triton kernels
# (store_kv, prefill_attention, decode_attention) in megainfer.kernels.triton_attention.
from .attention_ref import (check_attention_args, decode_attention_ref,  # noqa: E402
                            prefill_attention_ref, store_kv_ref, supported_head_dim)

__all__ += ["check_attention_args", "supported_head_dim", "store_kv_ref",
            "prefill_attention_ref", "decode_attention_ref"]

# Absorbed MLA (latent) attention: torch references and argument checks here; the Triton
# kernels (store_latent, mla_decode) in megainfer.kernels.triton_mla.
from .mla_ref import (check_mla_args, check_store_latent_args, mla_decode_ref,  # noqa: E402
                      mla_prefill_ref, store_latent_ref, supported_mla_dims)

__all__ += ["check_mla_args", "check_store_latent_args", "supported_mla_dims",
            "store_latent_ref", "mla_decode_ref", "mla_prefill_ref"]
