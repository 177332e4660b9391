"""Public entry points: pick Triton for CUDA tensors, the torch path for CPU tensors."""
from __future__ import annotations

from typing import Optional

import torch

from .reference import moe_align_ref, select_experts_ref
from .torch_moe import fused_moe_torch
from .weight_quant import QuantizedWeight

BACKENDS = ("torch", "triton")


class KernelInputError(ValueError):
    """A kernel argument has a bad shape, dtype or device; the message names it."""


def _backend(t: torch.Tensor, backend: Optional[str]) -> str:
    if backend is None:
        return "triton" if t.is_cuda else "torch"
    if backend not in BACKENDS:
        raise KernelInputError(f"backend={backend!r}: must be one of {BACKENDS}")
    return backend


def _check_moe(hidden, w1, w2, topk_weights, topk_ids, expert_map) -> None:
    if hidden.dim() != 2:
        raise KernelInputError(f"hidden: expected [M, K], got shape {tuple(hidden.shape)}")
    M, K = hidden.shape
    if w1.dim() != 3 or w1.shape[2] != K or w1.shape[1] % 2:
        raise KernelInputError(f"w1: expected [E, 2N, {K}], got shape {tuple(w1.shape)}")
    E, N = w1.shape[0], w1.shape[1] // 2
    if tuple(w2.shape) != (E, K, N):
        raise KernelInputError(f"w2: expected {(E, K, N)}, got shape {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M:
        raise KernelInputError(f"topk_ids: expected [{M}, k], got shape {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise KernelInputError(f"topk_weights: shape {tuple(topk_weights.shape)} != topk_ids "
                               f"shape {tuple(topk_ids.shape)}")
    if expert_map is not None and expert_map.dim() != 1:
        raise KernelInputError(f"expert_map: expected [E_global], got {tuple(expert_map.shape)}")


def fused_moe(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_map: Optional[torch.Tensor] = None, *,
              backend: Optional[str] = None) -> torch.Tensor:
    """Routed-expert FFN of M tokens: [M, K] -> [M, K] in hidden's dtype (see reference.py).
    ``w1``/``w2`` may be ``QuantizedWeight``s (weights kept in a stored format): the Triton
    kernels dequantise them in the tile (int4: in the ``nibbles`` layout only; torch's CPU int4
    layout takes the torch path)."""
    _check_moe(hidden, w1, w2, topk_weights, topk_ids, expert_map)
    if isinstance(w1, QuantizedWeight) and w1.fmt.name == "int4" \
            and w1.fmt.int4_layout != "nibbles":
        if backend == "triton":
            raise KernelInputError("backend='triton': int4 experts in torch's CPU layout run on "
                                   "the torch path only (the Triton kernels take 'nibbles')")
        backend = "torch"
    if _backend(hidden, backend) == "torch":
        return fused_moe_torch(hidden, w1, w2, topk_weights, topk_ids, expert_map)
    from .triton_moe import fused_moe_triton
    return fused_moe_triton(hidden, w1, w2, topk_weights, topk_ids, expert_map)


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                   renormalize: bool = False, correction_bias: Optional[torch.Tensor] = None,
                   num_groups: int = 1, topk_groups: int = 1, routed_scaling_factor: float = 1.0,
                   backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router scores -> (topk_weights [M, k] fp32, topk_ids [M, k] int64), HF semantics."""
    if router_logits.dim() != 2:
        raise KernelInputError(f"router_logits: expected [M, E], got {tuple(router_logits.shape)}")
    kw = dict(scoring=scoring, renormalize=renormalize, correction_bias=correction_bias,
              num_groups=num_groups, topk_groups=topk_groups,
              routed_scaling_factor=routed_scaling_factor)
    if _backend(router_logits, backend) == "torch":
        return select_experts_ref(router_logits, top_k, **kw)
    from .triton_routing import select_experts_triton
    return select_experts_triton(router_logits, top_k, **kw)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_size: int,
              expert_map: Optional[torch.Tensor] = None, *, backend: Optional[str] = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots sorted by expert and padded per expert to block_size (see ``moe_align_ref``)."""
    if _backend(topk_ids, backend) == "torch":
        return moe_align_ref(topk_ids, num_experts, block_size, expert_map)
    from .triton_align import moe_align_triton
    return moe_align_triton(topk_ids, num_experts, block_size, expert_map)
