"""Routed experts split over the TP ranks of a prefill replica (docs/pd.md).

Every TP rank of a prefill replica holds the same hidden states after each attention all-reduce,
so each can run the router on all of them; TP rank t holds the experts ``expert_slots_of(E, tp,
t)`` (a contiguous share, as the expert ranks split them), computes their partial sum for every
token (experts held elsewhere contribute zero, as an expert rank's), and one all-reduce over the
replica adds the shares: the routed output of single mode, on every rank. The router and the
shared expert run on every rank (small, replicated as the dense MLPs). So the expert weights and
their compute are divided by ``prefill_tp`` instead of repeated on every rank.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def expert_slots_of(num_experts: int, tp: int, tp_rank: int) -> list[int]:
    """The experts TP rank ``tp_rank`` of ``tp`` holds (contiguous; the first ranks get the
    larger shares when ``tp`` does not divide ``num_experts``)."""
    if tp > num_experts:
        raise ValueError(f"deploy.prefill_tp={tp}: more TP ranks than experts ({num_experts})")
    return list(range(tp_rank * num_experts // tp, (tp_rank + 1) * num_experts // tp))


class SplitExpertsMLP(nn.Module):
    """The ``mlp`` of an MoE layer on one prefill TP rank: ``inner`` (a ``MoEBlock`` built with
    this rank's expert slots) with its routed partial sum all-reduced over the replica."""

    def __init__(self, inner: nn.Module, all_reduce: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.inner, self.all_reduce = inner, all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        w, ids = self.inner.gate(x)
        out = self.all_reduce(self.inner.experts(x, w, ids))
        shared = self.inner.shared(x)
        return out if shared is None else out + shared


def split_experts(model, all_reduce) -> None:
    """Wrap every MoE layer's mlp of ``model`` (built with this rank's expert slots)."""
    for layer in model.layers:
        if layer.is_moe:
            layer.mlp = SplitExpertsMLP(layer.mlp, all_reduce)
