"""Attention over a paged KV cache, in plain torch (the seam where a GPU kernel plugs in).

KV cache of one layer: ``kv[2, num_blocks, block_size, kv_heads, head_dim]`` (0 = keys, 1 = values).
A step's batch is flat: ``T`` new tokens from ``S`` sequences, sequence after sequence.
A low-bit cache (float8 or uint8 fp4_e2m1, ``megainfer.kernels.kv_quant``) is quantised as the
new keys/values are written and dequantised after each step's gather (only the blocks of the
step's sequences, never the whole cache). With ``token_head`` scales
(``cache.kv_scale_granularity``) each stored row carries its own scale and no per-layer scale
is set or read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from megainfer.kernels import kv_quant

from .decode_attention import decode_attention
from .kv_gather import affine_layout, read_context


@dataclass
class AttentionMetadata:
    """Where a step's T new tokens come from and where their keys/values go.

    query_start_loc  [S+1] int64  token offsets of each sequence in the flat batch
    context_lens     [S]   int64  tokens already in the cache before this step
    seq_lens         [S]   int64  context_lens + new tokens
    block_tables     [S, max_blocks] int64  physical block ids (padding: 0, never read)
    slot_mapping     [T]   int64  block * block_size + offset for each new token (-1: write nothing)
    decode_seqs      [S_d] int64  the sequences with one new token (the torch path batches them)
    decode_rows      [S_d] int64  their rows in the flat batch

    The host lists beside the tensors let the attention code size its work without reading a
    device tensor back (no host synchronisation per layer). ``step_cache``: what every layer of
    the step shares and the first layer computes (rotary tables, the decode plan of
    ``decode_attention``: length groups, block ids, masks), keyed by what it depends on.
    """

    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    query_lens_list: list[int]
    seq_lens_list: list[int]
    decode_seqs: torch.Tensor = None
    decode_rows: torch.Tensor = None
    query_starts_list: list[int] = field(default_factory=list)
    decode_seqs_list: list[int] = field(default_factory=list)
    max_query_len: int = 0
    step_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: str | torch.device = "cpu") -> "AttentionMetadata":
        """From per-sequence lists: new-token counts, cached-token counts, block ids."""
        return cls.build_with(query_lens, context_lens, block_tables, block_size, device)[0]

    @classmethod
    def build_with(cls, query_lens: list[int], context_lens: list[int],
                   block_tables: list[list[int]], block_size: int,
                   device: str | torch.device = "cpu", extras: Sequence[torch.Tensor] = ()
                   ) -> tuple["AttentionMetadata", list[torch.Tensor]]:
        """``build``, plus 1-D int64 host tensors (token ids, positions, ...) moved to ``device``
        in the same single host-to-device copy. Everything is computed on the host."""
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        S, width = len(query_lens), max((len(b) for b in block_tables), default=0)
        if S and width:  # [S, max_blocks], padded with block 0 (never read: masked by seq_lens)
            table = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.long)
        else:
            table = torch.zeros(S, 1, dtype=torch.long)
        qlens = torch.tensor(query_lens, dtype=torch.long)  # [S]
        starts = torch.zeros(S + 1, dtype=torch.long)
        starts[1:] = torch.cumsum(qlens, 0)
        T = int(starts[-1])
        seq = torch.repeat_interleave(torch.arange(S), qlens)  # [T] sequence of each new token
        pos = torch.tensor(context_lens, dtype=torch.long)[seq] + torch.arange(T) - starts[seq]  # [T]
        slots = table[seq, pos // block_size] * block_size + pos % block_size  # [T]
        starts_list = starts.tolist()  # host tensor: no device sync
        dseqs = [i for i, n in enumerate(query_lens) if n == 1]
        host = [starts, torch.tensor(context_lens, dtype=torch.long),
                torch.tensor(seq_lens, dtype=torch.long), table, slots,
                torch.tensor(dseqs, dtype=torch.long),
                torch.tensor([starts_list[i] for i in dseqs], dtype=torch.long), *extras]
        dev = to_device_once(host, device)
        meta = cls(query_start_loc=dev[0], context_lens=dev[1], seq_lens=dev[2],
                   block_tables=dev[3], slot_mapping=dev[4], block_size=block_size,
                   query_lens_list=list(query_lens), seq_lens_list=seq_lens,
                   decode_seqs=dev[5], decode_rows=dev[6], query_starts_list=starts_list,
                   decode_seqs_list=dseqs, max_query_len=max(query_lens, default=0))
        return meta, dev[7:]

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_list))


def to_device_once(tensors: Sequence[torch.Tensor], device: str | torch.device) -> list[torch.Tensor]:
    """Host int64 tensors -> the same tensors on ``device`` through one copy (one pinned buffer,
    ``non_blocking``: the host does not wait for the GPU). On cpu: returned as they are."""
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                      head_dim: int, dtype=torch.float32, device="cpu") -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer, zeroed."""
    return [torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """No cache: one sequence. q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=scale)  # [Hq, T, D]
    return out.transpose(0, 1)


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] -> the cache at the flat slots; a low-bit cache quantises them first
    (per-layer scales set on the first non-zero write, ``kv_quant.scales_for_write``)."""
    Hkv = k.shape[1]
    flat = kv_cache.view(2, -1, Hkv, kv_cache.shape[-1])  # [2, NB*BS, Hkv, D or stored row]
    fmt = kv_quant.format_of(kv_cache)
    if fmt != "auto":
        scales, g = kv_quant.scales_for_write(kv_cache, k, v), kv_quant.granularity_of(kv_cache)
        k, v = kv_quant.quantize(k, scales[0], fmt, g), kv_quant.quantize(v, scales[1], fmt, g)
    if k.dtype != flat.dtype:
        k, v = k.to(flat.dtype), v.to(flat.dtype)
    flat[0, slot_mapping] = k
    flat[1, slot_mapping] = v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write k/v of the new tokens into the cache, then attend over each sequence's context.

    q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, NB, BS, Hkv, D] -> out [T, Hq, D].
    Decode sequences (one new token) run batched (``decode_attention``: one SDPA call per group
    of similar length); prefill chunks one by one.
    """
    store_kv_torch(k, v, kv_cache, meta.slot_mapping)
    if meta.max_query_len == 1:  # pure decode: every row is a sequence's one new token
        return decode_attention(q, kv_cache, meta, scale)
    out = torch.empty_like(q)
    qlens, starts = meta.query_lens_list, meta.query_starts_list
    if meta.decode_seqs_list:
        out[meta.decode_rows] = decode_attention(q[meta.decode_rows], kv_cache, meta, scale)
    for i, n in enumerate(qlens):
        if n > 1:
            _prefill_one(q, kv_cache, meta, i, starts[i], n, scale, out)
    return out


def _prefill_one(q, kv_cache, meta, i, start, n, scale, out):
    """One sequence's chunk of n queries at positions [ctx, ctx+n) over its first ctx+n keys."""
    L = meta.seq_lens_list[i]
    ctx = L - n
    blocks = meta.block_tables[i, : math.ceil(L / meta.block_size)]
    key = ("prefill layout", i)  # the same for every layer of the step
    if key not in meta.step_cache:
        meta.step_cache[key] = affine_layout(blocks)
    keys, vals = read_context(kv_cache, blocks, L, q.dtype, meta.step_cache[key])  # [L, Hkv, D]
    qpos = torch.arange(ctx, L, device=q.device)[:, None]
    mask = torch.arange(L, device=q.device)[None, :] <= qpos  # [n, L]
    o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), keys.transpose(0, 1),
                                       vals.transpose(0, 1), attn_mask=mask, scale=scale,
                                       enable_gqa=True)  # [Hq, n, D]
    out[start:start + n] = o.transpose(0, 1)
