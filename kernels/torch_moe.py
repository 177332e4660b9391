"""The CPU fast path of the fused MoE: sort slots by expert, then one matmul pair per expert
group or one grouped pair over all of them.

One row (a decode step of one sequence, all experts local): ``one_row_moe``, its k experts
in slot order. Otherwise (``grouped_moe``) no loop over tokens: one stable sort, one gather,
two matmuls per local expert that has slots (``cpu_gemm.linear``: the GEMM measured fastest
for that many rows at this thread count, over weights reordered once) with ``silu(gate) * up`` between them as two ops writing a fresh
contiguous tensor (the down GEMM's input, no copy), one scatter back into a per-slot buffer,
then one sum over each token's k slots (deterministic, independent of the expert grouping).
Per layer: 4 ops per expert with slots plus a fixed ~15 (``tests/unit/models/
test_decode_step_ops.py``). One activation over all experts' rows (a ``cat`` of the gate/up
outputs first) dispatches fewer ops but was slower at B = 64: a fresh MB-sized buffer per layer.

``grouped_mm_moe``: the same sort, gather and scatter around two ``torch._grouped_mm`` calls
over every local expert (no loop over experts, no oneDNN packs: torch's own CPU grouped GEMM
over the weights as stored). Which of the two runs is data: ``cpu_moe_rules`` (per model dtype,
rows and threads, measured by ``perf/bench/tune_cpu_moe.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import cpu_gemm, cpu_moe_rules
from .cpu_qgemm import stacked_qlinear
from .weight_quant import QuantizedWeight


def local_slot_experts(topk_ids: torch.Tensor, num_local: int,
                       expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """[M, k] global ids -> [M*k] local ids, with num_local marking an absent expert."""
    flat = topk_ids.reshape(-1).long()  # [S]
    if expert_map is None:
        return flat
    local = expert_map.to(flat.device).long()[flat]  # [S]
    return torch.where(local < 0, torch.full_like(local, num_local), local)


def fused_moe_torch(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as ``fused_moe_ref``; matmuls run in hidden's dtype, sums in fp32."""
    M, k = topk_ids.shape
    E_l, N = w1.shape[0], w2.shape[2]  # w1/w2: tensors or QuantizedWeights (logical shapes)
    K = hidden.shape[1]
    if M == 0 or E_l == 0:
        return torch.zeros(M, K, dtype=hidden.dtype, device=hidden.device)
    if (grouped_mm_ok(hidden, w1, w2)
            and cpu_moe_rules.method_for(hidden.dtype, M) == "grouped_mm"):  # measured rule
        return grouped_mm_moe(hidden, w1, w2, topk_weights, topk_ids, expert_map)
    if M == 1 and expert_map is None:
        return one_row_moe(hidden, w1, w2, topk_weights, topk_ids)
    return grouped_moe(hidden, w1, w2, topk_weights, topk_ids, expert_map)


def grouped_moe(hidden: torch.Tensor, w1, w2, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """``fused_moe_torch`` for M >= 1 rows: slots sorted and gathered by expert."""
    M, k = topk_ids.shape
    E_l, N = w1.shape[0], w2.shape[2]
    K = hidden.shape[1]
    local = local_slot_experts(topk_ids, E_l, expert_map)  # [S]
    order = torch.argsort(local, stable=True)  # [S] slots grouped by local expert
    counts = torch.bincount(local, minlength=E_l + 1).tolist()  # one host sync
    n_here = sum(counts[:E_l])
    if n_here == 0:  # every slot's expert lives elsewhere
        return torch.zeros(M, K, dtype=hidden.dtype, device=hidden.device)
    slots = order[:n_here]  # [n_here] slots of the experts on this rank
    x = hidden.index_select(0, torch.div(slots, k, rounding_mode="floor"))  # [n_here, K] rows
    here = [(e, n) for e, n in enumerate(counts[:E_l]) if n]  # experts with slots, in order
    ys, up, down = [], _stacked(w1), _stacked(w2)
    for (e, _), xe in zip(here, x.split_with_sizes([n for _, n in here])):  # xe [n, K]: views
        g = up(xe, e)  # [n, 2N]
        act = F.silu(g[:, :N]).mul_(g[:, N:])  # [n, N]: a fresh contiguous tensor, no copy
        ys.append(down(act, e))  # [n, K]
    y = _fp32(ys[0] if len(ys) == 1 else torch.cat(ys))  # [n_here, K]
    return _weighted_sum(y, slots, topk_weights, hidden.dtype)


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16)


def grouped_mm_ok(hidden: torch.Tensor, w1, w2) -> bool:
    """``grouped_mm_moe`` takes plain CPU fp32/bf16 weights in hidden's dtype (not stored
    formats: ``QuantizedWeight`` keeps the per-expert path)."""
    return (isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor) and hidden.is_cpu
            and hidden.dtype in GROUPED_MM_DTYPES and w1.dtype is hidden.dtype
            and w2.dtype is hidden.dtype and hasattr(torch, "_grouped_mm"))


def grouped_mm_moe(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``grouped_moe``'s contract in two grouped GEMMs over every local expert.

    hidden [M, K] (fp32 or bf16, CPU); w1 [E_l, 2N, K] (gate rows then up rows, HF's
    ``gate_up_proj`` as stored, read as the [E_l, K, 2N] view ``w1.transpose(1, 2)``); w2
    [E_l, K, N] (``down_proj``, read as [E_l, N, K]); topk_weights / topk_ids [M, k] (global
    ids; ``expert_map`` [E] global -> local id, -1 for an expert on another rank). The
    ``n_here`` slots of local experts, sorted by expert, are the rows of both calls; ``offs``
    [E_l] int32 are the cumulative row ends of each expert's group (an expert without slots: an
    empty group). Matmuls in hidden's dtype, the weighted sum over each token's k slots in fp32
    (``grouped_moe``'s scatter) -> [M, K] in hidden's dtype."""
    M, k = topk_ids.shape
    E_l, N, K = w1.shape[0], w2.shape[2], hidden.shape[1]
    local = local_slot_experts(topk_ids, E_l, expert_map)  # [S]
    order = torch.argsort(local, stable=True)  # [S] slots grouped by local expert
    ends = torch.bincount(local, minlength=E_l + 1)[:E_l].cumsum(0)  # [E_l] group ends
    n_here = int(ends[-1])  # one host sync
    if n_here == 0:  # every slot's expert lives elsewhere
        return torch.zeros(M, K, dtype=hidden.dtype, device=hidden.device)
    slots = order[:n_here]  # [n_here]
    x = hidden.index_select(0, torch.div(slots, k, rounding_mode="floor"))  # [n_here, K]
    offs = ends.to(torch.int32)  # [E_l]
    g = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)  # [n_here, 2N]
    act = F.silu(g[:, :N]).mul_(g[:, N:])  # [n_here, N]
    y = _fp32(torch._grouped_mm(act, w2.transpose(1, 2), offs=offs))  # [n_here, K]
    return _weighted_sum(y, slots, topk_weights, hidden.dtype)  # y: a fresh tensor


def _weighted_sum(y: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """y [n_here, K] fp32 (a fresh tensor, scaled in place), the slots its rows answer ->
    [M, K] in ``dtype``: each token's k slots weighted and summed in fp32, j = 0..k-1 in order
    (independent of the expert grouping); slots of absent experts read 0."""
    M, k = topk_weights.shape
    n_here, K = y.shape
    w = _fp32(topk_weights).reshape(-1).index_select(0, slots)  # [n_here]
    alloc = torch.empty if n_here == M * k else torch.zeros  # absent slots must read 0
    per_slot = alloc(M * k, K, dtype=torch.float32, device=y.device)  # [S, K]
    per_slot.index_copy_(0, slots, y.mul_(w[:, None]))
    out = per_slot.view(M, k, K).sum(1)  # [M, K]
    return out if out.dtype == dtype else out.to(dtype)


def _stacked(w):
    """run(x, e) = x @ w[e].T for a stacked weight, as stored (``QuantizedWeight``) or not."""
    return stacked_qlinear(w) if isinstance(w, QuantizedWeight) else cpu_gemm.stacked_linear(w)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def one_row_moe(hidden: torch.Tensor, w1, w2, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """One row (hidden [1, K], topk_* [1, k]), every expert local: its k experts in slot order,
    no sort, gather or scatter (11 fewer ops per layer), the same products and the same
    fp32 sum over the k slots as ``grouped_moe``, bit for bit (a test holds it)."""
    N = w2.shape[2]
    up, down = _stacked(w1), _stacked(w2)
    ys = []
    for e in topk_ids[0].tolist():  # one host sync, as grouped_moe's bincount
        g = up(hidden, e)  # [1, 2N]
        ys.append(down(F.silu(g[:, :N]).mul_(g[:, N:]), e))  # [1, K]
    y = _fp32(torch.cat(ys))  # [k, K] in slot order
    out = y.mul_(_fp32(topk_weights).view(-1, 1)).view(1, len(ys), -1).sum(1)  # [1, K]
    return out if out.dtype == hidden.dtype else out.to(hidden.dtype)
