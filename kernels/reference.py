"""Pure-torch references for the MoE kernels: the ground truth every fast path is tested against.

Layouts (same as Hugging Face transformers 5 fused experts):
  hidden        [M, K]        activations, fp32 or bf16
  w1            [E_l, 2N, K]  gate rows [0, N) then up rows [N, 2N) of each local expert
  w2            [E_l, K, N]   down projection of each local expert
  topk_ids      [M, k] int    expert ids in the global (physical slot) numbering
  topk_weights  [M, k] float  router weights
  expert_map    [E_g] int32   global id -> local index in w1/w2, -1 when the expert is not here
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def fused_moe_ref(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out[m] = sum_j w[m, j] * down_e(silu(gate_e(x_m)) * up_e(x_m)), e = topk_ids[m, j].

    The sum runs over j = 0..k-1 in order; experts absent from this rank (expert_map -1)
    contribute zero. Returns [M, K] in hidden's dtype.
    """
    M, k = topk_ids.shape
    out = torch.zeros(M, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    N = w2.shape[2]
    for m in range(M):
        for j in range(k):
            e = int(topk_ids[m, j])
            local = e if expert_map is None else int(expert_map[e])
            if local < 0:
                continue
            gu = F.linear(hidden[m].float(), w1[local].float())  # [2N]
            act = F.silu(gu[:N]) * gu[N:]  # [N]
            out[m] += topk_weights[m, j].float() * F.linear(act, w2[local].float())
    return out.to(hidden.dtype)
