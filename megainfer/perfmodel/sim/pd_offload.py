"""Decode attention offloaded to the prefill replicas in ``sim.pd.simulate_pd_job``
(``pd.offload``, docs/pd.md "Decode attention offloaded to the prefill ranks"): which requests
are offloaded (``Offload``, ``OffloadBook``: the rule of ``runtime/pd/offload_policy.py``'s
ledger) and, per decode iteration, each layer's round trip and remote attention
(``RemoteAttention``). docs/perfmodel.md, "The offload in the PD simulator"."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megainfer.config import ConfigError


@dataclass(frozen=True)
class Offload:
    """``ratio``: ``pd.offload_ratio`` (0: off, today's simulator); ``pool_blocks``: a prefill
    replica's offload pool (``pd.offload_blocks``; None: unlimited) of ``block_size``-token
    blocks; ``header_up_B`` / ``header_down_B``: pickled header bytes of one ``OffloadQKV`` /
    ``OffloadOut`` message (measured, docs/pd.md)."""

    ratio: float = 0.0
    pool_blocks: int | None = None
    block_size: int = 16
    header_up_B: float = 1100.0
    header_down_B: float = 500.0

    def __post_init__(self):
        if not (isinstance(self.ratio, (int, float)) and 0.0 <= self.ratio <= 1.0):
            raise ConfigError(f"offload ratio={self.ratio!r}: must be a number in [0, 1]")
        if self.pool_blocks is not None and not (isinstance(self.pool_blocks, int) and self.pool_blocks >= 0):
            raise ConfigError(f"offload pool_blocks={self.pool_blocks!r}: must be an integer >= 0 or None")
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ConfigError(f"offload block_size={self.block_size!r}: must be an integer >= 1")


class OffloadBook:
    """Rank 0's ledger over one job: the k-th eligible request (every simulated request has one
    sample and no prompt logprobs) is offloaded when ``floor((k+1) r) > floor(k r)`` and its
    prefill replica's pool has room for its whole life (prompt + output tokens, in blocks),
    held until it finishes."""

    def __init__(self, off: Offload, n_p: int):
        self.off = off
        self.active = off.ratio > 0
        cap = math.inf if off.pool_blocks is None else off.pool_blocks
        self.free = [cap] * n_p  # per prefill replica: pool blocks not promised
        self.held: dict[int, tuple[int, int]] = {}  # request -> (prefill replica, blocks)
        self.eligible = 0

    def decide(self, p: int, k: int, tokens: int) -> bool:
        """Whether request ``k``, prefilled on replica ``p``, is offloaded (``tokens``: its life)."""
        if not self.active:
            return False
        j, r = self.eligible, self.off.ratio
        self.eligible += 1
        if math.floor((j + 1) * r) <= math.floor(j * r):
            return False
        need = -(-int(tokens) // self.off.block_size)
        if need > self.free[p]:
            return False
        self.free[p] -= need
        self.held[k] = (p, need)
        return True

    def finished(self, k: int) -> None:
        held = self.held.pop(k, None)
        if held is not None:
            self.free[held[0]] += held[1]


class RemoteAttention:
    """One layer's offloaded attention of a decode iteration. Per (decode replica, micro-batch)
    and prefill replica p holding some of its rows: one message up with the rows' q [S, Hq, D],
    k and v [S, Hkv, D] (MLA: q and the new latent, ``kv_elems_override`` elements), one back
    with the output [S, Hq, D], each plus its header and the link latency, at ``bw`` (the KV
    stream's bandwidth); between them p's attention over the rows' cached KV: ``t_attn(S, c) -
    t_attn(S, 0)`` of the pool's layer times (the context part: reading the KV and q.k, p.v;
    the projections stay on the decode side) plus one kernel overhead. A prefill replica runs
    the messages of one micro-batch from every decode replica one after another, and answers
    after the layer of its own prefill step in flight: half a layer's wait on average."""

    def __init__(self, pool, model, bw: float, lat: float, off: Offload):
        s = pool.shape
        self.pool, self.bw, self.lat, self.off = pool, bw, lat, off
        q = s.num_heads * s.head_dim
        kv_new = s.kv_elems_override or 2 * s.num_kv_heads * s.head_dim
        self.up_B = (q + kv_new) * model.act_b  # bytes per request per layer, decode -> prefill
        self.down_B = q * model.act_b  # bytes per request per layer, prefill -> decode

    def attn_s(self, n: float, ctx: float) -> float:
        """Prefill-side seconds of one layer's attention of ``n`` rows at mean context ``ctx``."""
        if n <= 0:
            return 0.0
        t, tp = self.pool.t, self.pool.tp_p
        return max(t.t_attn(n, ctx, tp) - t.t_attn(n, 0.0, tp), 0.0) + self.pool.hw.kernel_overhead_s

    def layer(self, n: np.ndarray, ctx_sum: np.ndarray, wait_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(round trip [n_a, m] s per layer, prefill time [n_p] s per layer taken by it) from
        n, ctx_sum: [n_a, m, n_p] offloaded rows and the sum of their contexts; wait_s: [n_p]
        each prefill replica's wait before it answers (its step's layer in flight)."""
        n_a, m, n_p = n.shape
        work = np.zeros((n_a, m, n_p))
        for a in range(n_a):
            for i in range(m):
                for p in range(n_p):
                    if n[a, i, p] > 0:
                        work[a, i, p] = self.attn_s(n[a, i, p], ctx_sum[a, i, p] / n[a, i, p])
        serial = work.sum(axis=0)  # [m, n_p]: one micro-batch's messages on replica p, in turn
        o = self.off
        wire = 2 * self.lat + (n * self.up_B + o.header_up_B + n * self.down_B + o.header_down_B) / self.bw
        rt = np.where(n > 0, wire + serial[None] + wait_s[None, None], 0.0)  # [n_a, m, n_p]
        return rt.max(axis=2), serial.sum(axis=0)
