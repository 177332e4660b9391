"""Logits -> next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Everything runs on the logits' device. Random rows sample with the exponential race
(argmax of probs / E, E ~ Exp(1)). The noise is counter-based: E for row r, vocab position j is
a function of (key_r, j) alone, where key_r = mix_seed(request seed, output index) is computed
on the host. The function is Philox4x32-10 (Salmon et al., SC'11; the generator behind curand),
written with exact int64 torch ops, so CPU and CUDA give the same bits. A request's samples
therefore depend on its seed, its output index and its logits, never on which other requests
share the batch, on preemption, or on how many steps ran before.

Per step: one small host->device copy (row index, temperature, top-k, top-p, min-p and key of
every random row, in one fp64 table), no logits to the host, no random numbers drawn on the
host, and one device->host copy of the tokens at the end (``__call__``'s ``tolist``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .request import Request

_MASK64 = (1 << 64) - 1
_MASK32 = 0xFFFFFFFF
# Philox4x32 constants (Random123): round multipliers and Weyl key increments.
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_NOISE_CHUNK = 1 << 24  # noise values computed at once (bounds the int64 temporaries)


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index) -> a 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _mulhilo(a, m: int):
    """(hi, lo) 32-bit halves of a * m for a in [0, 2**32) (int64 tensor or int), m < 2**32.
    Split m in 16-bit limbs so no intermediate reaches 2**63: exact on every device."""
    p_hi = a * (m >> 16)  # < 2**48
    mid = ((p_hi & 0xFFFF) << 16) + a * (m & 0xFFFF)  # < 2**49
    return (p_hi >> 16) + (mid >> 32), mid & _MASK32


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = PHILOX_ROUNDS):
    """Philox4x32-R on 32-bit lanes held in int64 tensors (or Python ints); broadcasts.
    Counter (c0..c3), key (k0, k1) -> four 32-bit words."""
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def random_bits(key_lo: torch.Tensor, key_hi: torch.Tensor, n: int) -> torch.Tensor:
    """Per-row keys (32-bit halves, int64 [R]) -> int64 [R, n] of 32 random bits each.
    Position j is word j % 4 of Philox(counter (j // 4, 0, 0, 0), key): it depends on (key, j)
    only, not on R or n."""
    dev = key_lo.device
    ctr = torch.arange((n + 3) // 4, dtype=torch.int64, device=dev)[None, :]
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    words = philox4x32(ctr, zero, zero, zero, key_lo[:, None], key_hi[:, None])
    words = torch.broadcast_tensors(*words)
    return torch.stack(words, -1).flatten(1)[:, :n]


def bits_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """32 random bits -> float32 uniform in (0, 1): the top 24 bits on the 2**-24 grid, and in the
    lowest cell (where the exponential race is decided) 8 more bits, so never 0 and never 1."""
    hi = x >> 8
    return torch.where(hi > 0, hi.to(torch.float32) * 2.0 ** -24,
                       ((x & 0xFF).to(torch.float32) + 0.5) * 2.0 ** -32)


def uniform(keys: torch.Tensor, n: int) -> torch.Tensor:
    """63-bit keys (int64 [R], e.g. mix_seed outputs) -> float32 [R, n] uniforms in (0, 1)."""
    return bits_to_uniform(random_bits(keys & _MASK32, keys >> 32, n))


def _exponential(key_lo: torch.Tensor, key_hi: torch.Tensor, n: int) -> torch.Tensor:
    """Exp(1) noise [R, n] float32, finite and > 0 (-log1p(-u): small u gives small E, the
    values that decide the race, with the most precision)."""
    return torch.log1p(-bits_to_uniform(random_bits(key_lo, key_hi, n))).neg_()


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (temperature applied), per-row top_k [R] (V: off), top_p [R] (1: off),
    min_p [R] (0: off) -> logits with the dropped tokens at -inf. min-p on the full
    distribution, then top-k, then top-p over what is left; the most likely token always
    survives. A row with every filter off comes back bit-identical. No host sync."""
    R, V = logits.shape
    srt, idx = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(V, device=logits.device)[None, :]
    probs = srt.softmax(-1)
    drop = probs < min_p[:, None] * probs[:, :1]
    drop |= ranks >= top_k[:, None]
    kept = srt.masked_fill(drop, float("-inf")).softmax(-1)
    # mass before this token already >= top_p; top_p = 1 is off (a cumsum rounding above 1 must
    # not drop the tail, or a row's result would depend on whether another row filters)
    drop |= ((kept.cumsum(-1) - kept) >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, srt)


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
        """logits [R, V] fp32, one row per request -> R token ids."""
        return self.sample(logits, reqs).tolist()

    def sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Like ``__call__`` but the tokens stay on the logits' device (int64 [R]); no sync."""
        R, V = logits.shape
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if not rows:
            return logits.argmax(-1)
        dev = logits.device
        table = []  # one row per random request: index, temperature, top-k, top-p, min-p, key
        filters = False
        for i in rows:
            r, p = reqs[i], reqs[i].params
            key = mix_seed(r.seed, len(r.output_token_ids))
            top_k = V if p.top_k == -1 else p.top_k
            filters |= top_k < V or p.top_p < 1 or p.min_p > 0
            table.append((i, p.temperature, top_k, p.top_p, p.min_p, key & _MASK32, key >> 32))
        host = torch.tensor(table, dtype=torch.float64)  # all exact in fp64 (keys: 32+31 bits)
        if dev.type == "cuda":
            host = host.pin_memory()
        t = host.to(dev, non_blocking=True)  # the step's one host->device copy
        every = len(rows) == R
        idx = None if every else t[:, 0].long()
        sub = logits if every else logits.index_select(0, idx)
        sub = sub / t[:, 1:2].float()
        if filters:
            sub = filter_logits(sub, t[:, 2].long(), t[:, 3].float(), t[:, 4].float())
        probs = sub.softmax(-1)
        key_lo, key_hi = t[:, 5].long(), t[:, 6].long()
        n = len(rows)
        step = max(1, _NOISE_CHUNK // V)
        if step >= n:
            sampled = (probs / _exponential(key_lo, key_hi, V)).argmax(-1)
        else:
            sampled = torch.empty(n, dtype=torch.int64, device=dev)
            for s in range(0, n, step):
                e = _exponential(key_lo[s:s + step], key_hi[s:s + step], V)
                sampled[s:s + step] = (probs[s:s + step] / e).argmax(-1)
        if every:
            return sampled
        return logits.argmax(-1).index_copy_(0, idx, sampled)
