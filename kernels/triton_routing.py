"""Top-k routing in Triton: one program per BLOCK_M tokens, all E experts in registers.

softmax: the choice is made on the logits (same order as on the probabilities, and immune to
rounding ties), weights are the fp32 softmax probabilities. sigmoid (DeepSeek-V3): choice on
sigmoid + bias inside the topk_groups best groups (group score = sum of its top-2), weights are
the unbiased sigmoid scores. Ids come out sorted by choice score, descending; the selection
is k rounds of argmax, the lowest expert id winning a tie.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .reference import check_routing_args


@triton.jit
def _argmax_first(x, ar, PAD: tl.constexpr):
    """Per row: the max of x [BM, W] and the lowest column index holding it."""
    mx = tl.max(x, axis=1)  # [BM]
    return mx, tl.min(tl.where(x == mx[:, None], ar[None, :], PAD), axis=1)


@triton.jit
def _group_mask(choice, e_ar, G: tl.constexpr, GS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                G_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """True for experts in the TOPK_GROUPS groups with the largest sum of top-2 scores."""
    g_ar = tl.arange(0, G_PAD)
    gscore = tl.full([choice.shape[0], G_PAD], float("-inf"), tl.float32)  # [BM, G_PAD]
    for g in tl.static_range(G):
        v = tl.where((e_ar[None, :] // GS) == g, choice, float("-inf"))  # [BM, E_PAD]
        m1, i1 = _argmax_first(v, e_ar, E_PAD)
        s = m1
        if GS >= 2:
            s = m1 + tl.max(tl.where(e_ar[None, :] == i1[:, None], float("-inf"), v), axis=1)
        gscore = tl.where(g_ar[None, :] == g, s[:, None], gscore)
    keep = tl.zeros([choice.shape[0], G_PAD], tl.int32)
    for t in tl.static_range(TOPK_GROUPS):
        _, gi = _argmax_first(gscore, g_ar, G_PAD)
        hit = g_ar[None, :] == gi[:, None]
        keep = tl.where(hit, 1, keep)
        gscore = tl.where(hit, float("-inf"), gscore)
    kept = tl.zeros(choice.shape, tl.int32)  # [BM, E_PAD]
    for g in tl.static_range(G):
        kg = tl.sum(tl.where(g_ar[None, :] == g, keep, 0), axis=1)  # [BM]
        kept = tl.where((e_ar[None, :] // GS) == g, kg[:, None], kept)
    return kept > 0


@triton.jit
def _route(logits_ptr, bias_ptr, w_ptr, ids_ptr, M, E, s_lm, s_le, scale,
           TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
           HAS_BIAS: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
           TOPK_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
           G_PAD: tl.constexpr, K_PAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    e_ar = tl.arange(0, E_PAD)
    ok = (rows[:, None] < M) & (e_ar[None, :] < E)  # [BM, E_PAD]
    x = tl.load(logits_ptr + rows[:, None] * s_lm + e_ar[None, :] * s_le, mask=ok,
                other=float("-inf")).to(tl.float32)  # [BM, E_PAD]
    x = tl.where(rows[:, None] < M, x, 0.0)  # rows past M: finite, never stored
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + e_ar, mask=e_ar < E, other=0.0)[None, :]
        choice = tl.where(ok, choice, float("-inf"))
        if G > 1:
            choice = tl.where(_group_mask(choice, e_ar, G, GS, TOPK_GROUPS, G_PAD, E_PAD),
                              choice, float("-inf"))
    else:
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
        choice = x
    k_ar = tl.arange(0, K_PAD)
    W = tl.zeros([BLOCK_M, K_PAD], tl.float32)
    I = tl.zeros([BLOCK_M, K_PAD], tl.int64)
    for j in tl.static_range(TOP_K):
        _, idx = _argmax_first(choice, e_ar, E_PAD)  # [BM]
        hit = e_ar[None, :] == idx[:, None]  # [BM, E_PAD]
        wj = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # [BM]
        W = tl.where(k_ar[None, :] == j, wj[:, None], W)
        I = tl.where(k_ar[None, :] == j, idx.to(tl.int64)[:, None], I)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        if SIGMOID:
            W = W / (tl.sum(W, axis=1)[:, None] + 1e-20)
        else:
            W = W / tl.sum(W, axis=1)[:, None]
    W = W * scale
    out = (rows[:, None] < M) & (k_ar[None, :] < TOP_K)
    tl.store(w_ptr + rows[:, None] * TOP_K + k_ar[None, :], W, mask=out)
    tl.store(ids_ptr + rows[:, None] * TOP_K + k_ar[None, :], I, mask=out)


def select_experts_triton(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                          renormalize: bool = False,
                          correction_bias: Optional[torch.Tensor] = None, num_groups: int = 1,
                          topk_groups: int = 1, routed_scaling_factor: float = 1.0,
                          block_m: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``select_experts_ref``; ids sorted by choice score, descending."""
    M, E = router_logits.shape
    check_routing_args(E, top_k, scoring, num_groups, topk_groups)
    dev = router_logits.device
    weights = torch.empty(M, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(M, top_k, dtype=torch.int64, device=dev)
    if M == 0:
        return weights, ids
    sigmoid = scoring == "sigmoid"
    has_bias = sigmoid and correction_bias is not None
    bias = correction_bias.float().contiguous() if has_bias else weights
    G = num_groups if sigmoid else 1
    _route[(triton.cdiv(M, block_m),)](
        router_logits, bias, weights, ids, M, E, router_logits.stride(0),
        router_logits.stride(1), float(routed_scaling_factor), TOP_K=top_k, SIGMOID=sigmoid,
        RENORM=renormalize, HAS_BIAS=has_bias, G=G, GS=E // G, TOPK_GROUPS=topk_groups,
        BLOCK_M=block_m, E_PAD=triton.next_power_of_2(E), G_PAD=triton.next_power_of_2(G),
        K_PAD=triton.next_power_of_2(top_k))
    return weights, ids
