"""MoE kernels (installed as ``megainfer.kernels``): each fast path has a pure-torch reference."""
from .reference import fused_moe_ref

__all__ = ["fused_moe_ref"]
