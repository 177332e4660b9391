"""DeepSeek-V3 (and V2, see DEEPSEEK_V2): multi-head latent attention (MLA), YaRN RoPE on
the rope part of q/k only, sigmoid router with e_score_correction_bias and group-limited top-k, ungated shared experts,
dense MLPs in the first ``first_k_dense_replace`` layers. HF parameter names throughout.

MLA per layer (H heads, N = qk_nope_head_dim, P = qk_rope_head_dim, V = v_head_dim,
R = kv_lora_rank): q = q_proj(x) or q_b_proj(q_a_layernorm(q_a_proj(x))) [T, H, N+P];
kv_a_proj_with_mqa(x) = [c_kv (R) | k_pe (P)]; the cache keeps [kv_a_layernorm(c_kv) | rope(k_pe)]
(``megainfer.models.mla_attention``); kv_b_proj [H*(N+V), R] expands or is absorbed.
TP: heads split (q_proj / q_b_proj / kv_b_proj column-parallel by head, o_proj row-parallel
+ all-reduce); the latent (and q_a / kv_a projections) is the same on every rank.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .family import Family
from .layers import ParallelContext, RMSNorm, linear, rotate_half
from .mla_attention import TorchMLA, expanded_attention

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    renames=(),
    expert_parts={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
)
# DeepSeek-V2: the same MLA and layer plan; softmax routing (``moe.SoftmaxGroupRouter``) and
# HF's complex-number RoPE, which is the interleaved rotation (pairs) in another output order
DEEPSEEK_V2 = Family(
    name="deepseek_v2",
    renames=(),
    expert_parts={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(cfg) -> tuple[torch.Tensor, float]:
    """(inv_freq [P/2] float32 on the host, attention_factor), exactly HF's default / YaRN
    (transformers ``_compute_yarn_parameters`` with head_dim = qk_rope_head_dim)."""
    base, dim = cfg.rope_theta, cfg.qk_rope_head_dim
    y = cfg.rope_scaling
    if y is None:
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    factor = y.factor if y.factor is not None else (cfg.max_position_embeddings
                                                    / y.original_max_position_embeddings)
    attention_factor = y.attention_factor
    if attention_factor is None:
        if y.mscale and y.mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, y.mscale)
                                     / yarn_get_mscale(factor, y.mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)

    def corr_dim(rot):  # the dimension that turns `rot` times over the original context
        return (dim * math.log(y.original_max_position_embeddings / (rot * 2 * math.pi))
                / (2 * math.log(base)))
    low, high = corr_dim(y.beta_fast), corr_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extra = 1 - ramp  # [P/2] share of the extrapolated (unscaled) frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, attention_factor


def softmax_scale(cfg) -> float:
    """qk_head_dim^-0.5, times mscale^2 with YaRN's mscale_all_dim (HF ``yarn_apply_mscale``)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    y = cfg.rope_scaling
    if y is not None and y.mscale_all_dim:
        factor = y.factor or cfg.max_position_embeddings / y.original_max_position_embeddings
        m = yarn_get_mscale(factor, y.mscale_all_dim)
        scale = scale * m * m
    return scale


class MLARotary(nn.Module):
    """RoPE of the rope part (P dims): inv_freq float32; cos/sin * attention_factor (YaRN).
    ``interleave`` (HF ``rope_interleave``): pairs (x0, x1), (x2, x3), ... rotate together and
    come out de-interleaved [evens' | odds'] as in HF's ``apply_rotary_pos_emb_interleave``."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg, self.interleave = cfg, cfg.rope_interleave
        inv, self.attention_factor = rope_parameters(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)  # [P/2] float32

    def init_buffers(self, device) -> None:
        """Recompute inv_freq on the host (float32) and move it: meta builds hold no values."""
        self.inv_freq = rope_parameters(self.cfg)[0].to(device=device, dtype=torch.float32)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q [T, H, P], k [T, 1, P], positions [T] -> rotated q, k."""
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]  # [T, P/2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, P]
        cos = (emb.cos() * self.attention_factor).to(q.dtype)[:, None, :]
        sin = (emb.sin() * self.attention_factor).to(q.dtype)[:, None, :]
        if self.interleave:
            c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]

            def rot(x):
                x1, x2 = x[..., 0::2], x[..., 1::2]
                return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
            return rot(q), rot(k)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class MLAAttention(nn.Module):
    """``self_attn`` of a DeepSeek-V3 layer. forward(x [T, hidden]) -> [T, hidden]."""

    def __init__(self, cfg, par: ParallelContext):
        super().__init__()
        tp, r = par.tp_size, par.tp_rank
        if cfg.num_heads % tp:
            raise ValueError(f"deploy.attention_tp={tp}: must divide num_heads={cfg.num_heads}")
        self.par, self.heads = par, cfg.num_heads // tp
        N, P, V, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim, self.kv_lora_rank = N, P, V, R
        self.q_lora_rank, Hl, hid = cfg.q_lora_rank, self.heads, cfg.hidden_size
        bias = cfg.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hid, Hl * (N + P), bias=False)
            q_w = self.q_proj.weight
        else:
            self.q_a_proj = nn.Linear(hid, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # HF: default eps
            self.q_b_proj = nn.Linear(self.q_lora_rank, Hl * (N + P), bias=False)
            q_w = self.q_b_proj.weight
        self.kv_a_proj_with_mqa = nn.Linear(hid, R + P, bias=bias)
        self.kv_a_layernorm = RMSNorm(R, 1e-6)
        self.kv_b_proj = nn.Linear(R, Hl * (N + V), bias=False)
        self.o_proj = nn.Linear(Hl * V, hid, bias=bias)
        H = cfg.num_heads
        for p, dim, per in ((q_w, 0, N + P), (self.kv_b_proj.weight, 0, N + V),
                            (self.o_proj.weight, 1, V)):
            p.tp_shard = (dim, slice(r * Hl * per, (r + 1) * Hl * per), H * per)
        self.rotary = MLARotary(cfg)
        self.scale = softmax_scale(cfg)
        self.attn_backend = TorchMLA()  # MoECausalLM.set_attention_backend swaps it

    # W = kv_b_proj.weight.view(H, N + V, R): W_UK = W[:, :N], W_UV = W[:, N:]
    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:  # [S, H, N] -> [S, H, R]
        w = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_head_dim, -1)
        return torch.einsum("shn,hnr->shr", q_nope, w[:, : self.nope_dim])

    def unabsorb_o(self, o_latent: torch.Tensor) -> torch.Tensor:  # [S, H, R] -> [S, H, V]
        w = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_head_dim, -1)
        return torch.einsum("shr,hvr->shv", o_latent, w[:, self.nope_dim:])

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta,
                kv_cache: Optional[torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; without meta the T tokens are one uncached sequence."""
        T = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.heads, self.nope_dim + self.rope_dim)  # T may be 0 (idle replica)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self.rotary(q_pe, k_pe[:, None, :], positions)  # [T, H, P], [T, 1, P]
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe[:, 0]), dim=-1)  # [T, R+P]
        if meta is None:
            o = expanded_attention(self, q_nope, q_pe, latent, 0)  # [T, H, V]
        else:
            o = self.attn_backend(self, q_nope, q_pe, latent, kv_cache, meta)
        o = o.reshape(T, self.heads * self.v_head_dim)
        if self.par.tp_size == 1:
            return self.o_proj(o)
        out = self.par.all_reduce(linear(self.o_proj, o, with_bias=False))  # partial sums over ranks
        return out if self.o_proj.bias is None else out + self.o_proj.bias
