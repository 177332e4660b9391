"""A counter-based random generator on any torch device: Philox4x32-10 (Salmon et al., SC'11;
the generator behind curand) written with exact int64 torch ops, so CPU and CUDA give the same
bits. ``uniform(keys, n)`` and ``exponential`` give row r, position j a value that depends on
(key_r, j) alone; ``mix_seed(seed, index)`` makes the keys on the host (splitmix64)."""
from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
MASK32 = 0xFFFFFFFF
# Philox4x32 constants (Random123): round multipliers and Weyl key increments.
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10


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
    return (p_hi >> 16) + (mid >> 32), mid & MASK32


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = PHILOX_ROUNDS):
    """Philox4x32-R on 32-bit lanes held in int64 tensors (or Python ints); broadcasts.
    Counter (c0..c3), key (k0, k1) -> four 32-bit words."""
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & MASK32, (k1 + _PHILOX_W[1]) & MASK32
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
    return bits_to_uniform(random_bits(keys & MASK32, keys >> 32, n))


def exponential(key_lo: torch.Tensor, key_hi: torch.Tensor, n: int) -> torch.Tensor:
    """Exp(1) noise [R, n] float32, finite and > 0 (-log1p(-u): small u gives small E, the
    values that decide the race, with the most precision)."""
    return torch.log1p(-bits_to_uniform(random_bits(key_lo, key_hi, n))).neg_()
