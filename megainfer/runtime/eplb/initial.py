"""The static expert placement a job starts from (EPLB may move it later; see rebalancer.py)."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from megainfer.config import EplbConfig
from megainfer.eplb import Placement

log = logging.getLogger("megainfer.runtime")


def initial_placement(num_layers: int, num_experts: int, num_ranks: int, eplb: EplbConfig) -> Placement:
    """identity (slot e = expert e; with redundancy, balanced for uniform load) or shuffled.

    Slots split evenly over ranks: when num_experts + redundant_experts does not divide by the
    number of expert ranks, spare redundant slots are added up to the next multiple."""
    slots = -(-(num_experts + eplb.redundant_experts) // num_ranks) * num_ranks
    if slots != num_experts + eplb.redundant_experts:
        log.info("[placement] %d experts + %d redundant over %d expert ranks: using %d slots",
                 num_experts, eplb.redundant_experts, num_ranks, slots)
        eplb = replace(eplb, redundant_experts=slots - num_experts)
    if eplb.initial == "shuffled":
        g = torch.Generator().manual_seed(eplb.seed)
        rows = []
        for _ in range(num_layers):  # every expert once, the spare slots random replicas
            row = torch.cat([torch.arange(num_experts),
                             torch.randint(0, num_experts, (eplb.redundant_experts,), generator=g)])
            rows.append(row[torch.randperm(slots, generator=g)])
        return Placement.from_phy2log(torch.stack(rows), num_experts, num_ranks)
    if eplb.redundant_experts == 0:
        return Placement.identity(num_layers, num_experts, num_ranks)
    return Placement.from_rebalance(torch.ones(num_layers, num_experts), slots, 1, 1, num_ranks)
