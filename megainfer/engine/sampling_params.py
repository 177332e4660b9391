"""Per-request sampling parameters (vLLM-shaped), validated on construction."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import SamplingParamsError


def _check(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise SamplingParamsError(f"{name}={value!r}: {why}")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. ``seed`` makes a request's samples depend on nothing but its own
    seed and prompt (not on the batch it ran in). ``stop_token_ids`` stop even with ``ignore_eos``."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    min_p: float = 0.0
    max_tokens: int = 16
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "must be >= 0 (0 is greedy)")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", self.top_k,
               "must be -1 (disabled) or >= 1")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be an integer >= 1")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "must be an integer or None")
        for t in self.stop_token_ids:
            _check(_is_int(t) and t >= 0, "stop_token_ids", self.stop_token_ids,
                   "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN
