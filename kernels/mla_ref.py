"""Absorbed MLA (DeepSeek-V2/V3 multi-head latent attention) over a paged latent cache, in plain
torch: the references for ``triton_mla.py``, and argument checks.

Latent cache of one layer: ``cache[num_blocks, block_size, R + P]``, shared by all heads: per
token ``c_kv [R]`` (R = kv_lora_rank) then ``k_pe [P]`` (P = qk_rope_head_dim). Token ``pos``
of sequence ``s`` is at block ``block_tables[s, pos // block_size]``, offset ``pos %
block_size``. Absorbed: ``score[s,h,t] = (q_latent[s,h] . c_kv[t] + q_pe[s,h] . k_pe[t]) *
scale``, ``out[s,h] = softmax_t(score) @ c_kv``. The references loop over sequences, compute
in fp32 and return q's dtype: slow and obviously correct, for tests.
docs/kernels.md, "MLA (latent) attention".
"""
from __future__ import annotations

from typing import Optional

import torch

from . import kv_quant
from .attention_ref import DTYPES, INDEX_DTYPES
from .entry_points import KernelInputError


def latent_value_width(cache: torch.Tensor) -> int:
    """R + P of a latent cache [NB, BS, W]: fp4_e2m1 (uint8) packs 9 bytes per 16 values, and
    token_head rows (``kv_quant.granularity_of``) carry one inline scale per part (c_kv, k_pe)."""
    fmt, g = kv_quant.format_of(cache), kv_quant.granularity_of(cache)
    W = cache.shape[2] - 2 * kv_quant.row_scale_elems(fmt, g)
    return W * 16 // 9 if fmt == "fp4_e2m1" else W

MAX_KV_LORA_RANK = 512  # R: DeepSeek-V2/V3 use 512
MAX_ROPE_DIM = 64  # P: DeepSeek-V2/V3 use 64


def supported_mla_dims(kv_lora_rank: int, rope_dim: int) -> bool:
    """(R, P) the Triton MLA kernels take: 1 <= R <= 512, 1 <= P <= 64 (each padded to a power
    of two >= 16 with masks, so odd sizes work)."""
    return 1 <= int(kv_lora_rank) <= MAX_KV_LORA_RANK and 1 <= int(rope_dim) <= MAX_ROPE_DIM


def _index(name: str, t: torch.Tensor, ndim: int, size0: Optional[int], device) -> None:
    if t.dim() != ndim or (size0 is not None and t.shape[0] != size0):
        want = "[" + ", ".join(["*" if size0 is None else str(size0)] + ["*"] * (ndim - 1)) + "]"
        raise KernelInputError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise KernelInputError(f"{name}: expected int32 or int64, got {t.dtype}")
    if t.device != device:
        raise KernelInputError(f"{name}: on {t.device}, cache on {device}")


def _check_cache(cache: torch.Tensor, kv_lora_rank: int) -> int:
    """-> P. cache [NB, BS, R + P], fp32/bf16/fp16, last dim contiguous; R, P supported."""
    if cache.dim() != 3:
        raise KernelInputError(f"cache: expected [num_blocks, block_size, R + P], "
                               f"got {tuple(cache.shape)}")
    R = int(kv_lora_rank)
    # fp4_e2m1 (uint8, kernels/kv_quant.py): 9 bytes per 16 values, c_kv and k_pe packed apart
    P = latent_value_width(cache) - R
    if not supported_mla_dims(R, P):
        raise KernelInputError(
            f"kv_lora_rank: R={R} with cache width {cache.shape[2]} gives P={P}; the kernels "
            f"take 1 <= R <= {MAX_KV_LORA_RANK} and 1 <= P <= {MAX_ROPE_DIM} (R + P == width)")
    if cache.dtype not in DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        raise KernelInputError(f"cache: dtype {cache.dtype} not in fp32/bf16/fp16/float8/fp4")
    if cache.numel() and cache.stride(-1) != 1:
        raise KernelInputError("cache: last dim must be contiguous (stride 1)")
    return P


def check_store_latent_args(latent: torch.Tensor, cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> None:
    """latent [T, W] in the cache's dtype and device, W = cache.shape[-1], last dim contiguous;
    slot_mapping [T] int32/int64 on the same device. Raises ``KernelInputError``."""
    if cache.dim() != 3:
        raise KernelInputError(f"cache: expected [num_blocks, block_size, R + P], "
                               f"got {tuple(cache.shape)}")
    W = cache.shape[2]
    if latent.dim() != 2 or latent.shape[1] != W:
        raise KernelInputError(f"latent: expected [T, {W}], got {tuple(latent.shape)}")
    if cache.dtype not in DTYPES:
        raise KernelInputError(f"cache: dtype {cache.dtype} not in fp32/bf16/fp16")
    if latent.dtype != cache.dtype or latent.device != cache.device:
        raise KernelInputError(f"latent: expected {cache.dtype} on {cache.device}, got "
                               f"{latent.dtype} on {latent.device}")
    for name, t in (("latent", latent), ("cache", cache)):
        if t.numel() and t.stride(-1) != 1:
            raise KernelInputError(f"{name}: last dim must be contiguous (stride 1)")
    _index("slot_mapping", slot_mapping, 1, latent.shape[0], cache.device)


def check_mla_args(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                   kv_lora_rank: int, block_tables: Optional[torch.Tensor] = None,
                   seq_lens: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> None:
    """Raise ``KernelInputError`` naming the first bad argument.

    q_latent [S, H, R], q_pe [S, H, P], cache [NB, BS, R + P] with R = kv_lora_rank, all one
    dtype (fp32/bf16/fp16) on one device, last dims contiguous (other strides free);
    1 <= R <= 512, 1 <= P <= 64; block_tables [S, max_blocks], seq_lens [S] int32/int64;
    out like q_latent.
    """
    if q_latent.dim() != 3:
        raise KernelInputError(f"q_latent: expected [S, H, R], got {tuple(q_latent.shape)}")
    S, H, R = q_latent.shape
    if R != kv_lora_rank:
        raise KernelInputError(f"q_latent: last dim {R} != kv_lora_rank {kv_lora_rank}")
    P = _check_cache(cache, kv_lora_rank)
    if tuple(q_pe.shape) != (S, H, P):
        raise KernelInputError(f"q_pe: expected [{S}, {H}, {P}] (P = cache width - "
                               f"kv_lora_rank), got {tuple(q_pe.shape)}")
    if q_latent.dtype not in DTYPES:
        raise KernelInputError(f"q_latent: dtype {q_latent.dtype} not in fp32/bf16/fp16")
    for name, t in (("q_pe", q_pe), ("cache", cache)):
        # a float8 latent cache (kernels/kv_quant.py) is dequantised in the decode kernel
        if t.dtype != q_latent.dtype and not (name == "cache" and t.dtype in (
                torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)):
            raise KernelInputError(f"{name}: dtype {t.dtype} != q_latent dtype {q_latent.dtype}")
        if t.device != q_latent.device:
            raise KernelInputError(f"{name}: on {t.device}, q_latent on {q_latent.device}")
    for name, t in (("q_latent", q_latent), ("q_pe", q_pe), ("out", out)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise KernelInputError(f"{name}: last dim must be contiguous (stride 1)")
    if block_tables is not None:
        _index("block_tables", block_tables, 2, S, cache.device)
    if seq_lens is not None:
        _index("seq_lens", seq_lens, 1, S, cache.device)
    if out is not None:
        if (tuple(out.shape) != tuple(q_latent.shape) or out.dtype != q_latent.dtype
                or out.device != q_latent.device):
            raise KernelInputError(f"out: expected {tuple(q_latent.shape)} {q_latent.dtype} on "
                                   f"{q_latent.device}, got {tuple(out.shape)} {out.dtype} on "
                                   f"{out.device}")


def store_latent_ref(latent: torch.Tensor, cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """latent [T, R + P] (c_kv ++ k_pe) -> cache [NB, BS, R + P] at slot_mapping [T] (-1: skip)."""
    NB, BS, W = cache.shape
    flat = cache.view(NB * BS, W)
    keep = slot_mapping >= 0
    flat[slot_mapping[keep].long()] = latent[keep].to(cache.dtype)


def latent_context(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` latent rows of one sequence: [length, R + P], fp32."""
    BS = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    return cache[table_row.long()[pos // BS], pos % BS].float()


def _attend_latent(q_latent, q_pe, rows, R, qpos, scale):
    """q_latent [n, H, R], q_pe [n, H, P] at positions qpos [n], rows [L, R + P] -> [n, H, R]
    fp32, causal (query at qpos sees rows 0..qpos)."""
    c_kv, k_pe = rows[:, :R], rows[:, R:]
    scores = (torch.einsum("nhr,lr->hnl", q_latent.float(), c_kv)
              + torch.einsum("nhp,lp->hnl", q_pe.float(), k_pe)) * scale  # [H, n, L]
    mask = torch.arange(rows.shape[0], device=rows.device)[None, :] <= qpos[:, None]  # [n, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnl,lr->nhr", torch.softmax(scores, -1), c_kv)


def mla_decode_ref(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                   seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                   kv_lora_rank: int, num_splits: Optional[int] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Absorbed decode, one query per sequence over rows [0, seq_lens[s]): -> [S, H, R] in
    q_latent's dtype. seq_lens[s] == 0 gives zeros. ``num_splits`` is unused (same signature
    as the kernel)."""
    out = torch.zeros_like(q_latent) if out is None else out
    R = int(kv_lora_rank)
    for s, L in enumerate(seq_lens.tolist()):
        if L == 0:
            out[s] = 0
            continue
        rows = latent_context(cache, block_tables[s], L)
        qpos = torch.tensor([L - 1], device=cache.device)
        out[s] = _attend_latent(q_latent[s:s + 1], q_pe[s:s + 1], rows, R, qpos,
                                scale)[0].to(out.dtype)
    return out


def mla_prefill_ref(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, kv_lora_rank: int,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal varlen absorbed attention (for tests; prefill in the model uses the expanded form):
    q_latent [T, H, R], q_pe [T, H, P] -> [T, H, R]. Query i of sequence s (qlen tokens) sits
    at seq_lens[s] - qlen + i and sees rows [0, that position]; new rows must be stored."""
    out = torch.zeros_like(q_latent) if out is None else out
    R = int(kv_lora_rank)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, L in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if b == a:
            continue
        rows = latent_context(cache, block_tables[s], L)
        qpos = torch.arange(L - (b - a), L, device=cache.device)
        out[a:b] = _attend_latent(q_latent[a:b], q_pe[a:b], rows, R, qpos, scale).to(out.dtype)
    return out
