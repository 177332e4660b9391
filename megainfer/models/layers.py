"""Building blocks shared by every family: norm, rotary embedding, gated MLP, self-attention.

Parameter names follow Hugging Face so checkpoints load by name. Tensor-parallel attention
splits heads across ``ParallelContext.tp_size`` ranks: q/k/v column-parallel, o_proj
row-parallel followed by an all-reduce. Every other weight is replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megainfer.kernels import cpu_gemm, kv_quant
from megainfer.kernels.cpu_qgemm import qlinear_split

from .attention import AttentionMetadata, causal_attention
from .attention_backends import TorchAttention
from .kv_spec import kv_head_slice
from .quant_linear import QuantLinear


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in its attention replica's tensor-parallel group."""

    tp_rank: int = 0
    tp_size: int = 1
    all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over TP ranks

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank}: must be in [0, tp_size={self.tp_size})")
        if self.tp_size > 1 and self.all_reduce is None:
            raise ValueError(f"tp_size={self.tp_size}: tensor parallel needs an all_reduce")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, bit-identical in fp32 to the lines below (test_decode_step_ops)
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if x.dtype != torch.float32:
            # HF's weight * (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype) in 2 ops, not 7: the
            # weightless fused op computes in fp32 and casts once, bit-identical in bf16 and
            # fp16 (test_decode_step_ops)
            return self.weight * torch.rms_norm(x, (x.shape[-1],), None, self.eps)
        xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # fp32 x, other weight
        return self.weight * xf


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE, computed from positions each step in fp32."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.theta = theta  # init_buffers recomputes inv_freq from it
        # on the host even inside a meta build (init_buffers moves it to the model's device)
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
                               / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)  # [D/2] float32

    def init_buffers(self, device) -> None:
        """Recompute inv_freq (float32 always, computed on the host as in __init__) on device:
        the loader builds the model on the meta device, where buffers hold no values."""
        D = 2 * self.inv_freq.shape[0]
        inv = 1.0 / (self.theta ** (torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float()
                                    / D))
        self.inv_freq = inv.to(device=device, dtype=torch.float32)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                step_cache: Optional[dict] = None):
        """q [T, Hq, D], k [T, Hkv, D], positions [T] -> rotated q, k: ``x * cos +
        rotate_half(x) * sin`` as HF computes it, bit for bit (``rotate_half(x) * sin`` is
        the halves of x swapped times sin with its first half negated: the same products).
        q and k that are adjacent heads of one tensor (the fused q/k/v GEMM's output) rotate
        as one [T, Hq + Hkv, D] view: four ops for both."""
        cos, signed_sin = self.tables(positions, q.dtype, step_cache)
        qk = _adjacent_heads(q, k)
        if qk is not None:
            r = _rotate(qk, cos, signed_sin)
            return r[:, : q.shape[1]], r[:, q.shape[1]:]
        return _rotate(q, cos, signed_sin), _rotate(k, cos, signed_sin)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype,
               step_cache: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, signed sin [T, 1, D] in ``dtype`` (signed: HF's sin with its
        first half negated, ``_rotate``'s form); with ``step_cache`` (a step's
        ``AttentionMetadata.step_cache``) computed once per step for every layer of this
        theta and width, not once per layer."""
        key = ("rope", self.theta, self.inv_freq.shape[0], dtype, positions.data_ptr(),
               positions.shape[0])
        if step_cache is not None and key in step_cache:
            return step_cache[key]
        # fp32 whatever the model's dtype: bf16 inverse frequencies are whole radians off at
        # positions in the thousands (HF computes these in fp32 too, then casts cos/sin)
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # negation: exact
        out = cos[:, None, :], sin[:, None, :]
        if step_cache is not None:
            step_cache[key] = out
        return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> x * cos + swap_halves(x) * signed_sin: rotate_half's products, 4 ops."""
    T, H, D = x.shape
    swapped = x.reshape(T, H, 2, D // 2).flip(2).view(T, H, D)  # [x2, x1]
    return (x * cos).add_(swapped.mul_(signed_sin))


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> Optional[torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] as one [T, Hq + Hkv, D] view when k's heads follow q's
    in the same storage with the same strides, else None."""
    T, Hq, D = q.shape
    if (k.shape[0] != T or k.shape[2] != D or q.stride() != k.stride() or q.stride(2) != 1
            or q.stride(1) != D or k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
            or k.storage_offset() != q.storage_offset() + Hq * D or q.dtype != k.dtype):
        return None
    return q.as_strided((T, Hq + k.shape[1], D), q.stride())


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): dense layers and shared experts."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate, up = linear(self.gate_proj, x), linear(self.up_proj, x)  # [T, I] each
        return linear(self.down_proj, F.silu(gate).mul_(up))


def linear(layer: nn.Module, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
    """``layer(x)`` through ``cpu_gemm.linear`` (the GEMM measured fastest for the row count;
    plain ``F.linear`` off the CPU or in another dtype), or a ``QuantLinear``'s own path
    (its weight as stored). ``with_bias=False``: a row-parallel partial sum."""
    bias = layer.bias if with_bias else None
    if isinstance(layer, QuantLinear):
        return layer(x, with_bias)
    return cpu_gemm.linear(x, layer.weight, bias)


class SelfAttention(nn.Module):
    """GQA self-attention with optional q/k RMSNorm (Qwen3) and q/k/v bias (Qwen2)."""

    def __init__(self, cfg, par: ParallelContext):
        super().__init__()
        tp, r = par.tp_size, par.tp_rank
        if cfg.num_heads % tp:
            raise ValueError(f"deploy.attention_tp={tp}: must divide num_heads={cfg.num_heads}")
        if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            raise ValueError(f"deploy.attention_tp={tp}: must divide or be a multiple of "
                             f"num_kv_heads={cfg.num_kv_heads}")
        D = cfg.head_dim
        self.head_dim, self.scale, self.par = D, D ** -0.5, par
        self.q_heads = cfg.num_heads // tp
        kv_first, self.kv_heads = kv_head_slice(cfg.num_kv_heads, tp, r)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.q_heads * D, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * D // tp, cfg.hidden_size, bias=False)
        # which rows (q/k/v) or columns (o) of the full checkpoint tensor this rank holds
        q_rows = slice(r * self.q_heads * D, (r + 1) * self.q_heads * D)
        kv_rows = slice(kv_first * D, (kv_first + self.kv_heads) * D)
        q_full, kv_full = cfg.num_heads * D, cfg.num_kv_heads * D
        shards = [(self.q_proj.weight, 0, q_rows, q_full), (self.k_proj.weight, 0, kv_rows, kv_full),
                  (self.v_proj.weight, 0, kv_rows, kv_full), (self.o_proj.weight, 1, q_rows, q_full)]
        if bias:
            shards += [(self.q_proj.bias, 0, q_rows, q_full), (self.k_proj.bias, 0, kv_rows, kv_full),
                       (self.v_proj.bias, 0, kv_rows, kv_full)]
        for p, dim, sl, full in shards:
            p.tp_shard = (dim, sl, full)  # loader copies full.narrow(dim, sl) into p
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(D, cfg.rope_theta)
        self.attn_backend = TorchAttention()  # MoECausalLM.set_attention_backend swaps it

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: Optional[AttentionMetadata],
                kv_cache: Optional[torch.Tensor]) -> torch.Tensor:
        """x [T, H] -> [T, H]; without meta the T tokens are one sequence and nothing is cached."""
        T, D = x.shape[0], self.head_dim
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if isinstance(self.q_proj, QuantLinear):  # as stored, one GEMM where they concatenate
            q, k, v = qlinear_split(x, [p.qweight for p in projs], [p.bias for p in projs])
        else:
            q, k, v = cpu_gemm.linear_split(x, [p.weight for p in projs], [p.bias for p in projs])
        q, k, v = (q.view(T, self.q_heads, D), k.view(T, self.kv_heads, D),
                   v.view(T, self.kv_heads, D))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, positions, None if meta is None else meta.step_cache)
        if meta is None:
            o = causal_attention(q, k, v, self.scale)
        else:
            if self.par.tp_size > 1 and kv_cache is not None:
                agree_kv_scales(kv_cache, k, v, self.par)
            o = self.attn_backend(q, k, v, kv_cache, meta, self.scale)
        out = linear(self.o_proj, o.reshape(T, self.q_heads * D))  # [T, H], partial sum under TP
        if self.par.tp_size > 1:
            out = self.par.all_reduce(out)
        return out


def agree_kv_scales(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    par: ParallelContext) -> None:
    """A quantised cache's per-layer scales under TP: on the layer's first write, each rank's
    keys/values amax [2] are gathered over the TP group and the unset scales are set from
    their max: what one rank holding every head sets (tensor-parallel replicas then store the
    bytes TP 1 stores, and PD senders the bytes single mode stores). Once per cache tensor, at
    the same step on every rank (TP ranks run the same steps): collective-safe. A ``token_head``
    cache has nothing to agree on (each row carries its own scale): no collective."""
    fmt = kv_quant.format_of(cache)
    if (fmt == "auto" or getattr(cache, "kv_scales_agreed", False)
            or kv_quant.granularity_of(cache) == "token_head"):
        return
    cache.kv_scales_agreed = True
    local = torch.stack([x.detach().abs().amax().float() if x.numel() else
                         x.new_zeros((), dtype=torch.float32) for x in (k, v)])
    rows = local.new_zeros(par.tp_size, 2)
    rows[par.tp_rank] = local
    amax = par.all_reduce(rows).amax(0)  # [2]: every rank's, summed into its own row
    kv_quant.update_scales(kv_quant.scales_of(cache), fmt, amax[0], amax[1])
