"""A step's blocks read out of one layer's paged KV cache: in place where the block table
allows it, else copied into reused scratch buffers.

KV cache of one layer: ``kv[2, num_blocks, block_size, kv_heads, head_dim]`` (0 = keys,
1 = values). Stock torch has no attention op that reads a block table (SDPA wants one strided
tensor per batch). ``read_context`` hands SDPA a strided view of the cache itself when the
table is affine (row r reads blocks ``first + r * stride + [0, nb)``: ``affine_layout``, checked
once per step on the host) and the cache holds the query's float dtype; otherwise ``gather_context``
copies the blocks (one ``index_select`` per half, at memory speed) into buffers that only grow,
so their pages are touched once, and dequantises a low-bit cache (``megainfer.kernels.
kv_quant``) there, only those blocks.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from megainfer.kernels import kv_quant


class _GatherScratch:
    """Reused buffers for gathered K/V blocks. A fresh multi-MB tensor per layer and step costs
    more in first-touch page faults than the copy itself (3-8x on this VM), so the gather writes
    into buffers that only grow. Owned by this module, one set per thread; one pair per (dtype,
    device, block shape)."""

    def __init__(self):
        self.local = threading.local()

    def take(self, like: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        bufs = self.local.__dict__.setdefault("bufs", {})
        key = (like.dtype, like.device, tuple(like.shape[1:]))
        kv = bufs.get(key)
        if kv is None or kv[0].shape[0] < n:
            with torch.inference_mode(False):  # usable both inside and outside inference mode
                kv = tuple(torch.empty((max(n, 16), *like.shape[1:]), dtype=like.dtype,
                                       device=like.device) for _ in range(2))
            bufs[key] = kv
        return kv[0][:n], kv[1][:n]


_SCRATCH = _GatherScratch()


def gather_context(kv_cache: torch.Tensor, blocks: torch.Tensor, length: int,
                   dtype: torch.dtype = None):
    """blocks [..., nb] -> keys, values [..., nb*BS, Hkv, D] cut to ``length`` (views into
    scratch buffers, valid until the next gather). A quantised cache: the
    gathered blocks dequantised to ``dtype`` (new tensors)."""
    flat = blocks.reshape(-1)  # index_select: several times faster than advanced indexing on CPU
    kc, vc = _SCRATCH.take(kv_cache[0], flat.numel())  # [prod(...) * nb, BS, Hkv, D]
    torch.index_select(kv_cache[0], 0, flat, out=kc)
    torch.index_select(kv_cache[1], 0, flat, out=vc)
    shape = (*blocks.shape[:-1], -1, *kc.shape[-2:])
    kc, vc = kc.reshape(shape)[..., :length, :, :], vc.reshape(shape)[..., :length, :, :]
    fmt = kv_quant.format_of(kv_cache)
    if fmt != "auto":
        scales, g = kv_quant.scales_of(kv_cache), kv_quant.granularity_of(kv_cache)
        kc = kv_quant.dequantize(kc, scales[0], fmt, dtype, g)
        vc = kv_quant.dequantize(vc, scales[1], fmt, dtype, g)
    elif dtype is not None and kc.dtype != dtype:  # a cache kept in another float dtype
        kc, vc = kc.to(dtype), vc.to(dtype)
    return kc, vc


def affine_layout(blocks: torch.Tensor) -> Optional[tuple[int, int]]:
    """blocks [nb] or [n, nb] on the host -> (first, stride) when row r's blocks are
    ``first + r * stride + [0, nb)`` (each row one run, the runs equally spaced), else None;
    None on a device (the check would wait for it). One host copy of the table."""
    if blocks.device.type != "cpu" or blocks.numel() == 0:
        return None
    rows = blocks.reshape(-1, blocks.shape[-1]).tolist()
    first, nb = rows[0][0], len(rows[0])
    stride = rows[1][0] - first if len(rows) > 1 else nb
    if stride < 0:
        return None
    for r, row in enumerate(rows):
        start = first + r * stride
        if row != list(range(start, start + nb)):
            return None
    return first, stride


def context_in_place(kv_cache: torch.Tensor, blocks: torch.Tensor, length: int,
                     layout: Optional[tuple[int, int]], dtype: torch.dtype = None):
    """The keys, values [..., length, Hkv, D] of ``blocks`` [..., nb] as strided views of the
    cache, or None where they must be copied: no affine ``layout``, a low-bit cache, a cache in
    another dtype than ``dtype``, or a cache that is not one contiguous tensor."""
    if (layout is None or kv_quant.format_of(kv_cache) != "auto" or not kv_cache.is_contiguous()
            or (dtype is not None and kv_cache.dtype != dtype)):
        return None
    first, stride = layout
    _, NB, BS, H, D = kv_cache.shape  # [2, NB, BS, Hkv, D]
    rows = blocks.numel() // blocks.shape[-1]
    size, strides = (rows, length, H, D), (stride * BS * H * D, H * D, D, 1)
    at = kv_cache.storage_offset() + first * BS * H * D
    shape = (*blocks.shape[:-1], length, H, D)
    return (kv_cache.as_strided(size, strides, at).view(shape),
            kv_cache.as_strided(size, strides, at + NB * BS * H * D).view(shape))


def read_context(kv_cache: torch.Tensor, blocks: torch.Tensor, length: int,
                 dtype: torch.dtype = None, layout: Optional[tuple[int, int]] = None):
    """``context_in_place`` where it applies, else ``gather_context``: keys, values
    [..., length, Hkv, D] (views, valid until the cache or the next gather is written)."""
    kv = context_in_place(kv_cache, blocks, length, layout, dtype)
    return kv if kv is not None else gather_context(kv_cache, blocks, length, dtype)
