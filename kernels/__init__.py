"""MoE kernels (installed as ``megainfer.kernels``): each fast path has a pure-torch reference."""
from .reference import fused_moe_ref

fused_moe = fused_moe_ref  # until the fast paths land

__all__ = ["fused_moe", "fused_moe_ref"]
