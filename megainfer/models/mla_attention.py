"""Multi-head latent attention (DeepSeek MLA) over the paged latent cache, in torch.

Cache of one layer: ``latent[num_blocks, block_size, R + P]`` (R = kv_lora_rank, the normalised
``c_kv``; P = qk_rope_head_dim, the rotated ``k_pe``), one row per token shared by all heads.
Prefill (a chunk of > 1 new tokens) runs HF's expanded form over the sequence's whole context;
decode (one new token) is absorbed through ``W_UK`` / ``W_UV`` and never expands the cache per
head. A backend (``TorchMLA``, ``TritonMLA``) stores the new latents and attends: the seam the
Triton kernels (``megainfer.kernels.triton_mla``) plug into. A low-bit latent cache quantises
``c_kv`` and ``k_pe`` apart, the row stored as ``[q(c_kv) | q(k_pe)]``; reads dequantise only
the step's gathered blocks. docs/deepseek_v3.md, "Prefill expanded, decode absorbed"; "The KV
cache spec"."""
from __future__ import annotations

import logging
import math

import torch

from megainfer.kernels import kv_quant

log = logging.getLogger("megainfer.models")


def mla_decode_torch(q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     max_len: int | None = None) -> torch.Tensor:
    """Absorbed MLA decode. q_latent [S, H, R], q_pe [S, H, P], latent_cache [NB, BS, R+P],
    seq_lens [S], block_tables [S, max_blocks] -> o_latent [S, H, R] (q_latent's dtype).
    ``max_len``: the longest seq_len when the caller knows it on the host (no device sync)."""
    S, H, R = q_latent.shape
    BS = latent_cache.shape[1]
    L = int(seq_lens.max()) if max_len is None else max_len
    nb = math.ceil(L / BS)
    lat = latent_cache[block_tables[:, :nb]].reshape(S, nb * BS, latent_cache.shape[-1])[:, :L]
    lat = dequant_latent(lat, latent_cache, R, torch.float32)
    q = torch.cat((q_latent, q_pe), dim=-1)  # [S, H, R+P]
    scores = torch.einsum("shd,sld->shl", q.float(), lat.float()) * scale  # [S, H, L] fp32
    mask = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]  # [S, L]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)  # [S, H, L]
    return torch.einsum("shl,slr->shr", p, lat[..., :R].float()).to(q_latent.dtype)


def quant_latent(latent: torch.Tensor, cache: torch.Tensor, R: int) -> torch.Tensor:
    """latent [T, R+P] -> the rows a quantised cache stores (scales set on the first write)."""
    fmt, g = kv_quant.format_of(cache), kv_quant.granularity_of(cache)
    c_kv, k_pe = latent[:, :R], latent[:, R:]
    scales = kv_quant.scales_for_write(cache, c_kv, k_pe)
    return torch.cat([kv_quant.quantize(c_kv, scales[0], fmt, g),
                      kv_quant.quantize(k_pe, scales[1], fmt, g)], dim=-1)


def dequant_latent(rows: torch.Tensor, cache: torch.Tensor, R: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Gathered rows [..., W] of ``cache`` -> latents [..., R+P] in ``dtype`` (auto: cast only)."""
    fmt = kv_quant.format_of(cache)
    if fmt == "auto":
        return rows
    scales, g = kv_quant.scales_of(cache), kv_quant.granularity_of(cache)
    w = kv_quant.stored_dim(fmt, R, g)
    return torch.cat([kv_quant.dequantize(rows[..., :w], scales[0], fmt, dtype, g),
                      kv_quant.dequantize(rows[..., w:], scales[1], fmt, dtype, g)], dim=-1)


def store_latent_torch(latent: torch.Tensor, cache: torch.Tensor,
                       slot_mapping: torch.Tensor, R: int = 0) -> None:
    """latent [T, R+P] -> cache [NB, BS, R+P] at the flat slots (block * BS + offset).
    ``R`` (kv_lora_rank) is needed for a quantised cache only."""
    if kv_quant.format_of(cache) != "auto":
        latent = quant_latent(latent, cache, R)
    cache.view(-1, cache.shape[-1])[slot_mapping] = latent.to(cache.dtype)


def expanded_attention(mla, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor,
                       first_pos: int) -> torch.Tensor:
    """HF's form for one sequence: n queries at positions [first_pos, first_pos + n) over L
    latents [L, R+P] (positions 0..L-1). q_nope [n, H, N], q_pe [n, H, P] -> [n, H, V]."""
    n, H, N = q_nope.shape
    R = mla.kv_lora_rank
    L = latents.shape[0]
    kv = mla.kv_b_proj(latents[:, :R].to(q_nope.dtype)).view(L, H, N + mla.v_head_dim)
    k_nope, v = kv.split([N, mla.v_head_dim], dim=-1)  # [L, H, N], [L, H, V]
    k_pe = latents[:, None, R:].to(q_nope.dtype).expand(L, H, -1)  # [L, H, P]
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, n, N+P]
    k = torch.cat((k_nope, k_pe), dim=-1).transpose(0, 1)  # [H, L, N+P]
    qpos = torch.arange(first_pos, first_pos + n, device=q.device)[:, None]
    mask = torch.arange(L, device=q.device)[None, :] <= qpos  # [n, L]
    scores = torch.matmul(q, k.transpose(1, 2)) * mla.scale  # [H, n, L]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v.transpose(0, 1)).transpose(0, 1)  # [n, H, V]


def _context(cache: torch.Tensor, blocks: torch.Tensor, L: int, R: int = 0,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [nb] -> the first L latents of the sequence [L, R+P]."""
    return dequant_latent(cache[blocks].reshape(-1, cache.shape[-1])[:L], cache, R, dtype)


class TorchMLA:
    """Store the step's latents, then attend: decodes absorbed as one batch, prefill chunks
    expanded one by one. Returns [T, H, V]."""

    name = "torch"
    graphable = False  # sizes its work from the host lists of each step

    def store(self, latent, cache, meta, R: int = 0) -> None:
        store_latent_torch(latent, cache, meta.slot_mapping, R)

    def decode(self, q_latent, q_pe, cache, seq_lens, block_tables, scale, max_len):
        return mla_decode_torch(q_latent, q_pe, cache, seq_lens, block_tables, scale, max_len)

    def __call__(self, mla, q_nope, q_pe, latent, cache, meta) -> torch.Tensor:
        self.store(latent, cache, meta, mla.kv_lora_rank)
        T, H, _ = q_nope.shape
        out = q_nope.new_empty(T, H, mla.v_head_dim)
        if meta.decode_seqs_list:
            idx, rows = meta.decode_seqs, meta.decode_rows
            L = max(meta.seq_lens_list[i] for i in meta.decode_seqs_list)
            q_lat = mla.absorb_q(q_nope[rows])  # [S_d, H, R]
            o_lat = self.decode(q_lat, q_pe[rows], cache, meta.seq_lens[idx],
                                meta.block_tables[idx], mla.scale, L)
            out[rows] = mla.unabsorb_o(o_lat)  # [S_d, H, V]
        for i, n in enumerate(meta.query_lens_list):
            if n > 1:
                L, s = meta.seq_lens_list[i], meta.query_starts_list[i]
                lat = _context(cache, meta.block_tables[i, :math.ceil(L / meta.block_size)], L,
                               mla.kv_lora_rank, q_nope.dtype)
                out[s:s + n] = expanded_attention(mla, q_nope[s:s + n], q_pe[s:s + n], lat, L - n)
        return out


class TritonMLA(TorchMLA):
    """Triton latent store and split-KV absorbed decode (``megainfer.kernels.triton_mla``);
    prefill chunks stay on the torch path."""

    name = "triton"

    def __init__(self, kernels):
        self.kernels = kernels

    def store(self, latent, cache, meta, R: int = 0) -> None:
        fmt, scales = kv_quant.format_of(cache), None
        if fmt != "auto":  # quantised in the store kernel; scales set once, device-side
            scales = kv_quant.scales_for_write(cache, latent[:, :R], latent[:, R:])
        self.kernels.store_latent(latent, cache, meta.slot_mapping, scales, R)

    def decode(self, q_latent, q_pe, cache, seq_lens, block_tables, scale, max_len):
        fmt, scales = kv_quant.format_of(cache), None
        if fmt != "auto":  # float8 / fp4: dequantised in the kernel's registers
            scales = kv_quant.scales_of(cache)
        return self.kernels.mla_decode(q_latent.contiguous(), q_pe.contiguous(), cache, seq_lens,
                                       block_tables, scale, q_latent.shape[-1], scales=scales)


def make_mla_backend(name: str, R: int = 512, P: int = 64):
    """``torch`` or ``triton`` for latents of R + P; Triton falls back to torch (one log line)
    without ``megainfer.kernels.triton_mla`` or for dims its kernels do not take."""
    if name == "torch":
        return TorchMLA()
    if name != "triton":
        raise ValueError(f"attention_backend={name!r}: must be torch or triton")
    try:
        from megainfer.kernels import triton_mla
    except ImportError:
        log.warning("attention_backend=triton: no MLA Triton kernels "
                    "(megainfer.kernels.triton_mla) in this build; MLA layers use the torch path")
        return TorchMLA()
    from megainfer.kernels.mla_ref import supported_mla_dims
    if not supported_mla_dims(R, P):
        log.warning("attention_backend=triton: MLA kv_lora_rank=%d, qk_rope_head_dim=%d exceed "
                    "the Triton MLA kernels; MLA layers use the torch path", R, P)
        return TorchMLA()
    return TritonMLA(triton_mla)
