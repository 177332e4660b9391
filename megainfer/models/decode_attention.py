"""Decode attention in torch: the sequences of a step with one new token each, over the paged KV.

Every layer of a step reads the same sequences at the same lengths, so the plan (which blocks,
rows, masks) is made once per step and kept in ``AttentionMetadata.step_cache`` under a
``("decode", dtype)`` key; each layer reads its own blocks (``kv_gather.read_context``: a
strided view where a group's block table is affine, else a gather into scratch) and calls
``scaled_dot_product_attention`` with ``enable_gqa``. One length: one unmasked call; mixed
lengths: at most ``MAX_GROUPS`` groups of similar length (while a split saves more KV bytes
than ``GROUP_COST_BYTES``), each gathered only up to its own longest context.
docs/gpu.md, "Attention backends"."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .kv_gather import affine_layout, read_context

MAX_GROUPS = 4
# the host cost of one more group per layer (two gathers and an SDPA call, ~25 us at 1 thread on
# the 2-core VM of perf/bench/bench_decode_step.py) in KV bytes that a group no longer pads,
# gathers and reads (~0.15 us per 2 KiB token row there)
GROUP_COST_BYTES = 384 * 1024


@dataclass(frozen=True)
class DecodeGroup:
    """Rows [start, stop) of the length-sorted decode batch, read up to ``length`` tokens.

    blocks [n, nb] block ids; mask [n, 1, 1, length] additive (0 / -inf) in the query dtype,
    None when every row of the group has ``length`` tokens; layout: ``kv_gather.affine_layout``
    of ``blocks`` (the group is read in place), None when it must be gathered."""

    start: int
    stop: int
    length: int
    blocks: torch.Tensor
    mask: Optional[torch.Tensor]
    layout: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class DecodePlan:
    """The groups of a step's decode batch; ``order`` [S_d] the decode rows sorted by length
    and ``restore`` [S_d] its inverse, both None with a single group (rows stay in order)."""

    groups: tuple[DecodeGroup, ...]
    order: Optional[torch.Tensor]
    restore: Optional[torch.Tensor]


def split_by_length(lens: list[int], block_size: int, row_bytes: int,
                    max_groups: int = MAX_GROUPS, group_cost: int = GROUP_COST_BYTES
                    ) -> list[tuple[int, int]]:
    """``lens`` sorted ascending -> [start, stop) groups covering them in order. A group costs
    its rows times its longest length rounded up to blocks (what it gathers) times ``row_bytes``;
    the split that saves the most is taken while it saves more than ``group_cost``."""
    pad = [math.ceil(n / block_size) * block_size for n in lens]
    groups = [(0, len(lens))]
    while len(groups) < max_groups:
        best = (group_cost, None, None)  # (saving in bytes, group index, split row)
        for gi, (i, j) in enumerate(groups):
            top = pad[j - 1]
            for k in range(i + 1, j):  # rows [i, k) pad to pad[k-1] instead of top
                if pad[k - 1] < pad[k]:
                    saving = (k - i) * (top - pad[k - 1]) * row_bytes
                    if saving > best[0]:
                        best = (saving, gi, k)
        if best[1] is None:
            break
        i, j = groups[best[1]]
        groups[best[1]:best[1] + 1] = [(i, best[2]), (best[2], j)]
    return groups


def decode_plan(meta, dtype: torch.dtype, device, row_bytes: int) -> DecodePlan:
    """The step's plan for its decode rows (``meta.decode_seqs_list``), made by the first layer
    that asks and kept in ``meta.step_cache``."""
    key = ("decode", dtype)
    plan = meta.step_cache.get(key)
    if plan is not None:
        return plan
    lens = [meta.seq_lens_list[i] for i in meta.decode_seqs_list]
    idx = meta.decode_seqs  # [S_d] sequence of each decode row
    spans = [(0, len(lens))]
    order = restore = None
    if min(lens) < max(lens):
        by_len = sorted(range(len(lens)), key=lens.__getitem__)
        spans = split_by_length([lens[r] for r in by_len], meta.block_size, row_bytes,
                                MAX_GROUPS, GROUP_COST_BYTES)
        if len(spans) > 1:
            lens = [lens[r] for r in by_len]
            inverse = [0] * len(by_len)
            for at, r in enumerate(by_len):
                inverse[r] = at
            order, restore = (torch.tensor(p, dtype=torch.long).to(device)
                              for p in (by_len, inverse))
            idx = idx.index_select(0, order)
    groups = []
    for start, stop in spans:
        L = max(lens[start:stop])
        rows = idx[start:stop]  # [n]
        blocks = meta.block_tables.index_select(0, rows)[:, : math.ceil(L / meta.block_size)]
        mask = None
        if min(lens[start:stop]) < L:
            keep = torch.arange(L, device=device)[None, :] < meta.seq_lens[rows][:, None]
            mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(
                ~keep, float("-inf"))[:, None, None, :]  # [n, 1, 1, L]
        groups.append(DecodeGroup(start, stop, L, blocks, mask, affine_layout(blocks)))
    plan = meta.step_cache[key] = DecodePlan(tuple(groups), order, restore)
    return plan


def decode_attention(qd: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """The S_d sequences with one query each (qd [S_d, Hq, D], in ``decode_seqs`` order) over
    their cached contexts -> [S_d, Hq, D]."""
    Hkv, D = kv_cache.shape[-2], qd.shape[-1]
    plan = decode_plan(meta, qd.dtype, qd.device, 2 * Hkv * D * qd.element_size())
    if plan.order is not None:
        qd = qd.index_select(0, plan.order)  # [S_d, Hq, D] sorted by length
    outs = []
    for g in plan.groups:
        keys, vals = read_context(kv_cache, g.blocks, g.length, qd.dtype, g.layout)  # [n, L, Hkv, D]
        # enable_gqa: query head h reads kv head h // group, without materialising repeated K/V
        o = F.scaled_dot_product_attention(
            qd[g.start:g.stop, :, None, :], keys.transpose(1, 2), vals.transpose(1, 2),
            attn_mask=g.mask, scale=scale, enable_gqa=True)  # [n, Hq, 1, D]
        outs.append(o[:, :, 0, :])
    if plan.order is None:
        return outs[0]
    return torch.cat(outs).index_select(0, plan.restore)  # [S_d, Hq, D] back in decode order
