"""Attention times that price a prefill chunk and a decode batch by their own fits.

A decode micro-batch of b tokens is b sequences, each attending over its own cached context; a
prefill chunk of b tokens is a few prompts' consecutive tokens, and the two cost differently
per token (``perf/calibrate_bench50m.py`` measures both). ``ChunkTimes`` answers
``t_attn(b, ctx)`` with the decode times while b is at most ``max_decode_tokens`` (a
micro-batch cannot hold more decode tokens than the scheduler's ``max_num_seqs``) and with the
prefill times above it; a micro-batch mixing a few decodes into a chunk is priced as a chunk.
Everything else (``t_head``, ``t_expert``, ``wb``, ...) is the decode times'.
"""
from __future__ import annotations

from megainfer.config import ConfigError


class ChunkTimes:
    def __init__(self, decode, prefill, max_decode_tokens: int):
        if not (isinstance(max_decode_tokens, int) and max_decode_tokens >= 1):
            raise ConfigError(f"max_decode_tokens={max_decode_tokens!r}: must be an integer >= 1")
        self.decode, self.prefill, self.max_decode_tokens = decode, prefill, max_decode_tokens

    def t_attn(self, b: float, ctx: float, tp: int = 1) -> float:
        t = self.decode if b <= self.max_decode_tokens else self.prefill
        return t.t_attn(b, ctx, tp)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("decode", "prefill", "max_decode_tokens"):
            raise AttributeError(name)
        return getattr(self.decode, name)
