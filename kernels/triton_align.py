"""moe_align in Triton: slots sorted by expert (stable), each expert's group padded to a block.

Three launches, no atomics, so the order is deterministic and equals ``moe_align_ref``:
  1. count:   each program counts the experts of one chunk of BLOCK_S slots   -> cnt [P, E_PAD]
  2. offsets: one program turns counts into per-chunk prefixes, padded expert offsets, the
              padded total and the (mapped) expert of every block
  3. scatter: each program places its slots at offset[e] + prefix[chunk, e] + rank in chunk
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _align_count(ids_ptr, cnt_ptr, S, BLOCK_S: tl.constexpr, E_PAD: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    ids = tl.load(ids_ptr + offs, mask=offs < S, other=-1)
    e_ar = tl.arange(0, E_PAD)  # [E_PAD]
    onehot = (ids[:, None] == e_ar[None, :]).to(tl.int32)  # [BLOCK_S, E_PAD]
    tl.store(cnt_ptr + pid * E_PAD + e_ar, tl.sum(onehot, axis=0))


@triton.jit
def _align_offsets(cnt_ptr, prefix_ptr, off_ptr, bexp_ptr, emap_ptr, npad_ptr, P, num_blocks,
                   BLOCK_SIZE: tl.constexpr, E_PAD: tl.constexpr, BLOCK_B: tl.constexpr,
                   HAS_MAP: tl.constexpr):
    e_ar = tl.arange(0, E_PAD)
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for p in range(0, P):  # exclusive prefix over chunks, per expert
        c = tl.load(cnt_ptr + p * E_PAD + e_ar)
        tl.store(prefix_ptr + p * E_PAD + e_ar, running)
        running += c
    padded = (running + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE  # [E_PAD]
    ends = tl.cumsum(padded, axis=0)  # [E_PAD]
    tl.store(off_ptr + e_ar, ends - padded)
    total = tl.sum(padded, axis=0)
    tl.store(npad_ptr, total)
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        start = b * BLOCK_SIZE
        # the expert holding `start` is the first whose end is past it
        e = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)  # [BLOCK_B]
        used = start < total
        if HAS_MAP:
            e = tl.load(emap_ptr + e, mask=used, other=-1)
        tl.store(bexp_ptr + b, tl.where(used, e, -1), mask=b < num_blocks)


@triton.jit
def _align_scatter(ids_ptr, prefix_ptr, off_ptr, sorted_ptr, S, BLOCK_S: tl.constexpr,
                   E_PAD: tl.constexpr):
    pid = tl.program_id(0)
    r_ar = tl.arange(0, BLOCK_S)
    offs = pid * BLOCK_S + r_ar  # [BLOCK_S] slot ids
    ok = offs < S
    ids = tl.load(ids_ptr + offs, mask=ok, other=-1)
    same = (ids[:, None] == ids[None, :]) & (r_ar[None, :] < r_ar[:, None])  # [BLOCK_S, BLOCK_S]
    rank = tl.sum(same.to(tl.int32), axis=1)  # earlier slots of my expert in this chunk
    safe = tl.where(ok, ids, 0)
    base = tl.load(off_ptr + safe, mask=ok, other=0) + \
        tl.load(prefix_ptr + pid * E_PAD + safe, mask=ok, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=ok)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                     expert_map: Optional[torch.Tensor] = None, block_s: int = 64
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same outputs as ``moe_align_ref``; no host synchronisation."""
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()  # [S]
    S = ids.numel()
    max_padded = S + num_experts * (block_size - 1)
    num_blocks = triton.cdiv(max_padded, block_size)
    E_PAD = triton.next_power_of_2(num_experts)
    P = triton.cdiv(S, block_s)
    sorted_ids = torch.full((max_padded,), S, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    npad = torch.empty(1, dtype=torch.int32, device=dev)
    cnt = torch.empty(max(P, 1), E_PAD, dtype=torch.int32, device=dev)
    prefix = torch.empty_like(cnt)
    off = torch.empty(E_PAD, dtype=torch.int32, device=dev)
    emap = ids if expert_map is None else expert_map.to(device=dev, dtype=torch.int32)
    if P:
        _align_count[(P,)](ids, cnt, S, BLOCK_S=block_s, E_PAD=E_PAD)
    _align_offsets[(1,)](cnt, prefix, off, block_expert, emap, npad, P, num_blocks,
                         BLOCK_SIZE=block_size, E_PAD=E_PAD, BLOCK_B=64,
                         HAS_MAP=expert_map is not None)
    if P:
        _align_scatter[(P,)](ids, prefix, off, sorted_ids, S, BLOCK_S=block_s, E_PAD=E_PAD)
    return sorted_ids, block_expert, npad
