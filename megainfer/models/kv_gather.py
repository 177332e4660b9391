"""A step's blocks read out of one layer's paged KV cache into reused scratch buffers.

KV cache of one layer: ``kv[2, num_blocks, block_size, kv_heads, head_dim]`` (0 = keys,
1 = values). ``gather_context`` copies the blocks a batch of sequences reads (one
``index_select`` per half, at memory speed) and, for a low-bit cache (``megainfer.kernels.
kv_quant``), dequantises only those blocks. Stock torch has no attention op that reads a block
table in place (SDPA wants one strided tensor per batch), so the copy stays; it lands in buffers
that only grow, so its pages are touched once.
"""
from __future__ import annotations

import threading

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
