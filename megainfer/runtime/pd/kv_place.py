"""Placing a transferred layer of KV blocks into a decode replica's paged cache.

Model-dtype caches: a plain copy into the reserved blocks. Quantised caches
(``cache.kv_cache_dtype`` fp8 / fp4) with ``tensor`` scales: where the decode cache's scale for a
part is unset it adopts the sender's and the bytes are placed as they are (lossless); equal
scales: the same; a part whose scale differs is requantised from the sender's scale to the
decode cache's (``kv_quant``). The cache is never widened to full precision. ``token_head``
caches: the bytes are placed verbatim and no scales travel (``sender_scales`` is None).
docs/pd.md, "Layer-wise KV streaming".
"""
from __future__ import annotations

from typing import Optional

import torch

from megainfer.kernels import kv_quant
from megainfer.models.kv_spec import BLOCK_AXIS


def sender_scales(kv: torch.Tensor):
    """The layer's float32 [2] scales, which travel with each segment (a quantised cache with
    per-layer scales), else None (``auto``; ``token_head``: every row carries its own scale)."""
    if kv_quant.format_of(kv) == "auto" or kv_quant.granularity_of(kv) != "tensor":
        return None
    return kv_quant.scales_of(kv)


def place(kv: torch.Tensor, kind: str, blocks: list[int], buf: torch.Tensor,
          src_scales: Optional[torch.Tensor], parts: tuple = (),
          heads: Optional[tuple[int, int]] = None) -> None:
    """Staged blocks ``buf`` (the cache's storage format) into ``blocks`` of ``kv`` (GQA
    ``heads``: (first, count) of the cache's heads ``buf`` holds, the rest left alone; several
    prefill TP ranks each send a run). A quantised part whose scale differs from the sender's
    is requantised (module docstring)."""
    dim = BLOCK_AXIS[kind]
    idx = torch.tensor(blocks, dtype=torch.long, device=kv.device)
    buf = buf.to(kv.device)
    if src_scales is not None and kv_quant.granularity_of(kv) == "tensor":
        fmt, dst = kv_quant.format_of(kv), kv_quant.scales_of(kv)
        src = src_scales.to(dst.device)
        dst.copy_(torch.where(dst > 0, dst, src))  # unset: adopt the sender's
        if not torch.equal(dst, src):
            buf = _requant(buf, kind, fmt, src, dst, parts)
    if kv.element_size() == 1:
        kv, buf = kv.view(torch.uint8), buf.view(torch.uint8)
    if heads is not None:
        kv = kv.narrow(3, heads[0], heads[1])  # a view: the copy lands in the cache
    kv.index_copy_(dim, idx, buf)


def _requant(buf, kind, fmt, src, dst, parts):
    """Dequantise with the sender's scale, quantise with this cache's, part by part (only the
    parts whose scales differ); stacked as bytes (float8 tensors do not stack on every device)."""
    def redo(x, i):
        if src[i] == dst[i]:
            return x.view(torch.uint8)
        y = kv_quant.dequantize(x, src[i], fmt, torch.float32)
        return kv_quant.quantize(y, dst[i], fmt).to(buf.dtype).view(torch.uint8)
    if kind == "gqa":
        return torch.stack([redo(buf[i], i) for i in range(2)]).view(buf.dtype)
    w = kv_quant.stored_dim(fmt, parts[0])
    return torch.cat([redo(buf[..., :w], 0), redo(buf[..., w:], 1)], dim=-1).view(buf.dtype)
