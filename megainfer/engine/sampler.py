"""Logits -> next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Random rows sample with the exponential race (argmax of probs / E, E ~ Exp(1)), with the noise
drawn from a generator seeded by (request seed, output index) alone. So a request's samples
depend on its seed and its logits, never on which other requests share the batch, on
preemption, or on how many steps ran before.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .request import Request

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index) -> a 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (temperature applied), per-row top_k [R] (V: off), top_p [R], min_p [R]
    -> logits with the dropped tokens at -inf. min-p on the full distribution, then top-k,
    then top-p over what is left; the most likely token always survives."""
    R, V = logits.shape
    srt, idx = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(V, device=logits.device)[None, :]
    probs = srt.softmax(-1)
    drop = probs < min_p[:, None] * probs[:, :1]
    drop |= ranks >= top_k[:, None]
    kept = srt.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (kept.cumsum(-1) - kept) >= top_p[:, None]  # mass before this token already >= top_p
    drop[:, 0] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, srt)


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
        """logits [R, V] fp32, one row per request -> R token ids."""
        tokens = logits.argmax(-1)  # [R] greedy for every row first
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rows:
            tokens[rows] = self._sample([reqs[i] for i in rows], logits[rows])
        return tokens.tolist()

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        R, V = logits.shape
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=dev)
        logits = logits / temp[:, None]
        if any(r.params.top_k != -1 or r.params.top_p < 1 or r.params.min_p > 0 for r in reqs):
            top_k = torch.tensor([V if r.params.top_k == -1 else r.params.top_k for r in reqs],
                                 device=dev)
            top_p = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32, device=dev)
            min_p = torch.tensor([r.params.min_p for r in reqs], dtype=torch.float32, device=dev)
            logits = filter_logits(logits, top_k, top_p, min_p)
        probs = logits.softmax(-1)  # [R, V]
        noise = torch.stack([self._exponential(r.seed, len(r.output_token_ids), V) for r in reqs])
        return (probs / noise.to(dev)).argmax(-1)

    @staticmethod
    def _exponential(seed: int, index: int, V: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(mix_seed(seed, index))
        u = torch.rand(V, generator=g, dtype=torch.float32)  # [V] in [0, 1)
        return (-torch.log1p(-u)).clamp_min(1e-20)  # Exp(1); u = 0 gives 0 -> clamped
