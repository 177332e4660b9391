"""Paged attention in plain torch: the references for ``triton_attention.py``, and argument checks.

KV cache of one layer: ``kv_cache[2, num_blocks, block_size, Hkv, D]`` (0 = keys, 1 = values).
Token ``pos`` of sequence ``s`` lives at block ``block_tables[s, pos // block_size]``, offset
``pos % block_size``; a slot is ``block * block_size + offset``. A step's batch is flat: T new
tokens from S sequences, sequence after sequence. The references loop over sequences, compute
in fp32 and return q's dtype; they are slow and obviously correct, for tests.
"""
from __future__ import annotations

from typing import Optional

import torch

from .entry_points import KernelInputError

MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def supported_head_dim(d: int) -> bool:
    """Head dims the Triton kernels take: any 1 <= d <= 256 (padded to a power of two >= 16)."""
    return 1 <= int(d) <= MAX_HEAD_DIM


def _shape(name: str, t: torch.Tensor, want: tuple) -> None:
    """want: ints, or None for 'any size'."""
    ok = t.dim() == len(want) and all(w is None or w == n for w, n in zip(want, t.shape))
    if not ok:
        pretty = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
        raise KernelInputError(f"{name}: expected shape {pretty}, got {tuple(t.shape)}")


def _index(name: str, t: torch.Tensor, want: tuple, device) -> None:
    _shape(name, t, want)
    if t.dtype not in INDEX_DTYPES:
        raise KernelInputError(f"{name}: expected int32 or int64, got {t.dtype}")
    if t.device != device:
        raise KernelInputError(f"{name}: on {t.device}, kv_cache on {device}")


# a low-bit KV cache the Triton kernels read (dequantised in registers; kernels/kv_quant.py)
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def token_head_cache(kv_cache: torch.Tensor, D: Optional[int] = None) -> bool:
    """A GQA cache whose rows carry their own scale (``cache.kv_scale_granularity=token_head``,
    kernels/kv_quant.py): marked when allocated, or told by the row width: fp4 rows of
    D/2 + D/16 + 1 bytes (not a multiple of 9), float8 rows of D + 2 for head dim ``D``."""
    g = getattr(kv_cache, "kv_granularity", None)
    if g is not None:
        return g == "token_head" and kv_cache.dtype in FP8_CACHE_DTYPES + (torch.uint8,)
    if kv_cache.dtype == torch.uint8:
        return kv_cache.shape[-1] % 9 != 0
    return kv_cache.dtype in FP8_CACHE_DTYPES and D is not None and kv_cache.shape[-1] == D + 2


def check_attention_args(q: torch.Tensor, kv_cache: torch.Tensor,
                         block_tables: Optional[torch.Tensor] = None,
                         seq_lens: Optional[torch.Tensor] = None,
                         query_start_loc: Optional[torch.Tensor] = None,
                         out: Optional[torch.Tensor] = None, *, decode: bool = False) -> None:
    """Raise ``KernelInputError`` naming the first bad argument.

    q [T, Hq, D] (decode: T == S), kv_cache [2, NB, BS, Hkv, D] in q's dtype (fp32/bf16/fp16),
    block_tables [S, max_blocks], seq_lens [S], query_start_loc [S+1] int32/int64, out like q;
    all on one device; head_dim contiguous (other strides free). Hq % Hkv == 0, 1 <= D <= 256.
    """
    _shape("q", q, (None, None, None))
    T, Hq, D = q.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise KernelInputError(f"kv_cache: expected [2, num_blocks, block_size, Hkv, D], "
                               f"got {tuple(kv_cache.shape)}")
    Hkv = kv_cache.shape[3]
    rows = int(token_head_cache(kv_cache, D))  # token_head: + the row's inline scale
    if kv_cache.dtype == torch.uint8:  # fp4_e2m1 (kernels/kv_quant.py): D/2 codes + D/16 scales
        if D % 16 or kv_cache.shape[4] != D // 2 + D // 16 + rows:
            raise KernelInputError(f"kv_cache: an fp4_e2m1 cache of head_dim {D} has rows of "
                                   f"{D // 2 + D // 16 + rows} bytes (D % 16 == 0), got "
                                   f"{kv_cache.shape[4]}")
    elif kv_cache.shape[4] != D + 2 * rows:
        raise KernelInputError(f"q: head_dim {D} != kv_cache head_dim {kv_cache.shape[4]}")
    if not supported_head_dim(D):
        raise KernelInputError(f"q: head_dim {D} not supported (1..{MAX_HEAD_DIM})")
    if Hkv == 0 or Hq % Hkv:
        raise KernelInputError(f"q: {Hq} heads is not a multiple of kv_cache's {Hkv} kv heads")
    if q.dtype not in DTYPES:
        raise KernelInputError(f"q: dtype {q.dtype} not in fp32/bf16/fp16")
    if kv_cache.dtype != q.dtype and kv_cache.dtype not in FP8_CACHE_DTYPES + (torch.uint8,):
        raise KernelInputError(f"kv_cache: dtype {kv_cache.dtype} != q dtype {q.dtype} "
                               "(nor a float8 / fp4 uint8 cache)")
    if q.device != kv_cache.device:
        raise KernelInputError(f"q: on {q.device}, kv_cache on {kv_cache.device}")
    for name, t in (("q", q), ("kv_cache", kv_cache), ("out", out)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise KernelInputError(f"{name}: head_dim must be contiguous (stride 1)")
    S = None
    if block_tables is not None:
        _index("block_tables", block_tables, (None, None), q.device)
        S = block_tables.shape[0]
    if seq_lens is not None:
        _index("seq_lens", seq_lens, (S,), q.device)
        S = seq_lens.shape[0]
    if query_start_loc is not None:
        _index("query_start_loc", query_start_loc, (None if S is None else S + 1,), q.device)
    if decode and S is not None and T != S:
        raise KernelInputError(f"q: decode takes one query per sequence, got {T} for {S}")
    if out is not None:
        if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device:
            raise KernelInputError(f"out: expected {tuple(q.shape)} {q.dtype} on {q.device}, got "
                                   f"{tuple(out.shape)} {out.dtype} on {out.device}")


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> kv_cache[0/1] at slot_mapping [T] (slot -1: row skipped)."""
    _, NB, BS, Hkv, D = kv_cache.shape
    flat = kv_cache.view(2, NB * BS, Hkv, D)  # [2, slots, Hkv, D]
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep].long()
    flat[0, slots] = k[keep].to(kv_cache.dtype)
    flat[1, slots] = v[keep].to(kv_cache.dtype)


def _context(kv_cache: torch.Tensor, table_row: torch.Tensor, length: int):
    """First ``length`` keys and values of one sequence: [length, Hkv, D] each, fp32."""
    BS = kv_cache.shape[2]
    pos = torch.arange(length, device=kv_cache.device)
    blocks = table_row.long()[pos // BS]  # [length]
    return kv_cache[0, blocks, pos % BS].float(), kv_cache[1, blocks, pos % BS].float()


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, qpos: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions qpos [n], keys/vals [L, Hkv, D] -> [n, Hq, D] fp32, causal."""
    group = q.shape[1] // keys.shape[1]
    keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)  # [L, Hq, D]
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale  # [Hq, n, L]
    mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= qpos[:, None]  # [n, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), vals)


def prefill_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                          scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal varlen attention over the cache (new K/V already stored). q [T, Hq, D] -> [T, Hq, D].

    Query i of sequence s (qlen = its token count) sits at seq_lens[s] - qlen + i and attends to
    keys [0, that position]. ``max_query_len`` is unused here (kept for the same signature).
    """
    out = torch.zeros_like(q) if out is None else out
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, L in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if b == a:
            continue
        keys, vals = _context(kv_cache, block_tables[s], L)
        qpos = torch.arange(L - (b - a), L, device=q.device)  # [n]
        out[a:b] = _attend(q[a:b], keys, vals, qpos, scale).to(q.dtype)
    return out


def decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, scale: float,
                         num_splits: Optional[int] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One query per sequence at position seq_lens[s] - 1: q [S, Hq, D] -> [S, Hq, D].
    seq_lens[s] == 0 gives zeros. ``num_splits`` is unused here (same signature as the kernel)."""
    out = torch.zeros_like(q) if out is None else out
    for s, L in enumerate(seq_lens.tolist()):
        if L == 0:
            out[s] = 0
            continue
        keys, vals = _context(kv_cache, block_tables[s], L)
        qpos = torch.tensor([L - 1], device=q.device)
        out[s] = _attend(q[s:s + 1], keys, vals, qpos, scale)[0].to(q.dtype)
    return out
