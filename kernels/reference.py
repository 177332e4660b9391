"""Pure-torch references for the MoE kernels: the ground truth every fast path is tested against.

Layouts (same as Hugging Face transformers 5 fused experts):
  hidden        [M, K]        activations, fp32 or bf16
  w1            [E_l, 2N, K]  gate rows [0, N) then up rows [N, 2N) of each local expert
  w2            [E_l, K, N]   down projection of each local expert
  topk_ids      [M, k] int    expert ids in the global (physical slot) numbering
  topk_weights  [M, k] float  router weights
  expert_map    [E_g] int32   global id -> local index in w1/w2, -1 when the expert is not here

These are written for clarity, not speed (``fused_moe_ref`` loops over tokens).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

SCORINGS = ("softmax", "sigmoid")


class RoutingError(ValueError):
    """A routing argument is inconsistent; the message names the argument."""


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


def check_routing_args(num_experts: int, top_k: int, scoring: str, num_groups: int,
                       topk_groups: int) -> None:
    """Raise RoutingError naming the argument that cannot work with these experts."""
    if scoring not in SCORINGS:
        raise RoutingError(f"scoring={scoring!r}: must be one of {SCORINGS}")
    if not 1 <= top_k <= num_experts:
        raise RoutingError(f"top_k={top_k}: must be in [1, num_experts={num_experts}]")
    if num_groups < 1 or num_experts % num_groups:
        raise RoutingError(f"num_groups={num_groups}: must divide num_experts={num_experts}")
    if not 1 <= topk_groups <= num_groups:
        raise RoutingError(f"topk_groups={topk_groups}: must be in [1, num_groups={num_groups}]")
    if top_k > topk_groups * (num_experts // num_groups):
        raise RoutingError(f"top_k={top_k}: more than the {topk_groups} kept groups hold")


def select_experts_ref(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                       renormalize: bool = False, correction_bias: Optional[torch.Tensor] = None,
                       num_groups: int = 1, topk_groups: int = 1,
                       routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face routing, op for op. Returns (topk_weights [M,k] fp32, topk_ids [M,k] int64).

    softmax (Mixtral, Qwen2/3-MoE): softmax in fp32 over all experts, topk (sorted), divide
    by the sum when ``renormalize``. sigmoid (DeepSeek-V3): choose by sigmoid + bias within
    the ``topk_groups`` groups with the largest sum of their top-2 biased scores; weights are
    the unbiased scores, divided by (sum + 1e-20) when ``renormalize``. Both end with
    ``* routed_scaling_factor``. HF's DeepSeek uses ``topk(sorted=False)``; so do we, so the
    ids come out in the same order as HF's on the same device.
    """
    M, E = router_logits.shape
    check_routing_args(E, top_k, scoring, num_groups, topk_groups)
    logits = router_logits.float()  # [M, E]
    if scoring == "softmax":
        probs = torch.softmax(logits, dim=-1)  # [M, E]
        weights, ids = torch.topk(probs, top_k, dim=-1)  # [M, k]
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = logits.sigmoid()  # [M, E]
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if num_groups > 1:
            grouped = choice.view(M, num_groups, E // num_groups)  # [M, G, E/G]
            group_scores = grouped.topk(min(2, E // num_groups), dim=-1)[0].sum(dim=-1)  # [M, G]
            group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [M, G]
            score_mask = group_mask.unsqueeze(-1).expand(-1, -1, E // num_groups).reshape(M, E)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [M, k]
        weights = scores.gather(1, ids)  # [M, k]
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights.float(), ids.long()


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                  expert_map: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the M*k (token, j) slots by global expert and pad each expert's group to block_size.

    Returns
      sorted_ids   [M*k + E*(block_size-1)] int32: slot ids (slot = m*k + j), stable within an
                   expert; padding and the unused tail hold the sentinel M*k
      block_expert [cdiv(len(sorted_ids), block_size)] int32: the local expert of each block
                   (expert_map applied; -1 for an expert not on this rank or an unused block)
      num_padded   [1] int32: the number of sorted_ids entries in use (a multiple of block_size)
    Experts with no slots take no blocks.
    """
    flat = topk_ids.reshape(-1).long()  # [S]
    S = flat.numel()
    max_padded = S + num_experts * (block_size - 1)
    sorted_ids = torch.full((max_padded,), S, dtype=torch.int32, device=flat.device)
    block_expert = torch.full((-(-max_padded // block_size),), -1, dtype=torch.int32,
                              device=flat.device)
    pos = 0
    for e in range(num_experts):
        slots = (flat == e).nonzero().flatten()  # ascending slot ids
        if slots.numel() == 0:
            continue
        sorted_ids[pos:pos + slots.numel()] = slots.int()
        nblocks = -(-slots.numel() // block_size)
        local = e if expert_map is None else int(expert_map[e])
        block_expert[pos // block_size: pos // block_size + nblocks] = local
        pos += nblocks * block_size
    return sorted_ids, block_expert, torch.tensor([pos], dtype=torch.int32, device=flat.device)
