"""The attention backends behind one seam: ``torch`` (the reference) and ``triton``.

A backend writes one layer's new keys and values into the paged KV cache, then attends:

    q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, NB, BS, Hkv, D], meta: AttentionMetadata
    -> out [T, Hq, D] in q's dtype

``torch`` gathers each sequence's blocks and calls ``scaled_dot_product_attention``. ``triton``
(``megainfer.kernels.triton_attention``): a KV store through the slot mapping, then split-KV
decode with a merge pass, or varlen prefill/extend; it reads only device tensors and host-side
sizes, so it needs no host sync and can be captured in a CUDA graph. Both read a low-bit cache
(``cache.kv_cache_dtype``). docs/gpu.md, "Attention backends"; docs/kv_cache.md."""
from __future__ import annotations

import torch

from megainfer.kernels import kv_quant

from .attention import AttentionMetadata, paged_attention


class TorchAttention:
    name = "torch"
    graphable = False  # sizes its gathers from the host lists of each step

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, meta, scale)


class TritonAttention:
    name = "triton"
    graphable = True

    def __init__(self):
        from megainfer.kernels import triton_attention  # imports Triton: only when chosen
        self.kernels = triton_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kern = self.kernels
        fmt, scales = kv_quant.format_of(kv_cache), None
        if fmt != "auto":  # float8 / fp4: quantised in the store kernel
            scales = kv_quant.scales_for_write(kv_cache, k, v)  # device-side, set once
        kern.store_kv(k, v, kv_cache, meta.slot_mapping, scales)
        if meta.max_query_len == 1:  # pure decode: q is [S, Hq, D], one row per sequence
            return kern.decode_attention(q, kv_cache, meta.seq_lens, meta.block_tables, scale,
                                         scales=scales)
        return kern.prefill_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                                      meta.block_tables, meta.max_query_len, scale,
                                      scales=scales)


BACKENDS = {"torch": TorchAttention, "triton": TritonAttention}


def make_attention_backend(name: str):
    """One of ``BACKENDS`` by name (a fixed table: nothing is built from a user's class name)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r}: must be one of {', '.join(BACKENDS)}")
    return BACKENDS[name]()
