"""Decode attention offloaded to the prefill replicas in ``sim.pd.simulate_pd_job``
(``pd.offload``, docs/pd.md "Decode attention offloaded to the prefill ranks"): which requests
are offloaded (``Offload``, ``OffloadBook``: ``perfmodel/offload_rule.py``'s rule, which
``runtime/pd/offload_policy.py``'s ledger applies too) and, per decode iteration, each layer's
round trip and remote attention (``RemoteAttention``). docs/perfmodel.md, "The offload in the PD simulator"."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megainfer.config import ConfigError
from megainfer.config.pd import OFFLOAD_POLICIES
from megainfer.perfmodel.offload_rule import (Decoding, OffloadCandidate, blocks_for,
                                             homes_for_room, picks_auto, picks_by_ratio)


@dataclass(frozen=True)
class Offload:
    """``ratio``: ``pd.offload_ratio`` (0: off, today's simulator); ``pool_blocks``: a prefill
    replica's offload pool (``pd.offload_blocks``; None: unlimited) of ``block_size``-token
    blocks; ``header_up_B`` / ``header_down_B``: pickled header bytes of one ``OffloadQKV`` /
    ``OffloadOut`` message (measured, docs/pd.md); ``policy``: ``pd.offload_policy`` (``auto``:
    ``offload_rule.picks_auto``, ``ratio`` ignored); ``tpot_slo_s``: the TPOT SLO ``auto`` keeps
    the predicted TPOT within (None: none)."""

    ratio: float = 0.0
    pool_blocks: int | None = None
    block_size: int = 16
    header_up_B: float = 1100.0
    header_down_B: float = 500.0
    policy: str = "ratio"
    tpot_slo_s: float | None = None
    # a request the policy would offload whose pool is short sends decoding ones home
    # (``pd.offload_return_home``): their KV moves to the decode replica between two iterations
    return_home: bool = True
    # the share of its prefill step's layer in flight a busy prefill replica makes a message wait:
    # 0.5, this runtime (it answers between layers); 0, attention kernels run beside the prefill
    # (Adrenaline's SM partition)
    layer_wait: float = 0.5

    def __post_init__(self):
        if self.policy not in OFFLOAD_POLICIES:
            raise ConfigError(f"offload policy={self.policy!r}: must be one of {', '.join(OFFLOAD_POLICIES)}")
        if self.tpot_slo_s is not None and not (isinstance(self.tpot_slo_s, (int, float)) and self.tpot_slo_s > 0):
            raise ConfigError(f"offload tpot_slo_s={self.tpot_slo_s!r}: must be a positive number or None")
        if not (isinstance(self.layer_wait, (int, float)) and 0.0 <= self.layer_wait <= 1.0):
            raise ConfigError(f"offload layer_wait={self.layer_wait!r}: must be a number in [0, 1]")
        if not (isinstance(self.ratio, (int, float)) and 0.0 <= self.ratio <= 1.0):
            raise ConfigError(f"offload ratio={self.ratio!r}: must be a number in [0, 1]")
        if self.pool_blocks is not None and not (isinstance(self.pool_blocks, int) and self.pool_blocks >= 0):
            raise ConfigError(f"offload pool_blocks={self.pool_blocks!r}: must be an integer >= 0 or None")
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ConfigError(f"offload block_size={self.block_size!r}: must be an integer >= 1")


class OffloadBook:
    """Rank 0's ledger over one job (every simulated request has one sample and no prompt
    logprobs, so all are eligible): ``offload_rule``'s choice at hand-out, the pool's room for
    the request's whole life (prompt + output tokens, in blocks) held until it finishes or goes
    home; for ``auto`` also each decode replica's KV reserved by the local requests handed to
    it (``decode_kv_tokens``; None: unlimited, so ``auto`` never offloads). A request chosen
    whose pool is short sends requests decoding from it home, oldest first, while their decode
    replicas' KV holds their lives, as ``runtime/pd/offload_policy.py``'s ledger does
    (``take_homes``)."""

    def __init__(self, off: Offload, n_p: int, n_a: int = 1, decode_kv_tokens: int | None = None):
        self.off = off
        self.auto = off.policy == "auto"
        self.active = off.ratio > 0 or self.auto
        cap = math.inf if off.pool_blocks is None else off.pool_blocks
        self.free = [cap] * n_p  # per prefill replica: pool blocks not promised
        self.held: dict[int, tuple[int, int]] = {}  # request -> (prefill replica, blocks)
        self.kv_cap = math.inf if decode_kv_tokens is None else decode_kv_tokens
        self.local = [0] * n_a  # per decode replica: whole-life tokens of its local requests
        self.held_local: dict[int, tuple[int, int]] = {}  # local request -> (decode replica, tokens)
        self.life: dict[int, tuple[int, int]] = {}  # offloaded request -> (decode replica, tokens)
        self.running: dict[int, None] = {}  # offloaded requests decoding, in start order
        self.homes: list[int] = []  # sent home, not taken yet
        self.eligible = 0

    def decide(self, p: int, a: int, k: int, tokens: int, tpot_s: float | None = None) -> bool:
        """Whether request ``k``, prefilled on replica ``p`` and decoded on ``a``, is offloaded
        (``tokens``: its life; ``tpot_s``: the predicted TPOT with it offloaded, for ``auto``)."""
        if not self.active:
            return False
        need = blocks_for(tokens, self.off.block_size)
        if self.auto:  # pressure and the TPOT SLO; the pool's room below
            go = picks_auto(OffloadCandidate(need, need, int(tokens),
                                             self.kv_cap - self.local[a], tpot_s, self.off.tpot_slo_s))
        else:
            go = picks_by_ratio(self.eligible, self.off.ratio)
        go = go and (need <= self.free[p] or self._make_room(p, need))
        self.eligible += 1
        if not go:
            self.local[a] += int(tokens)
            self.held_local[k] = (a, int(tokens))
            return False
        self.free[p] -= need
        self.held[k] = (p, need)
        self.life[k] = (a, int(tokens))
        return True

    def started(self, k: int) -> None:
        """Request ``k`` decodes from now on (offloaded ones may then be sent home)."""
        if k in self.held:
            self.running[k] = None

    def _make_room(self, p: int, need: int) -> bool:
        if not self.off.return_home:
            return False
        go = homes_for_room(need, self.free[p], [Decoding(k, self.held[k][1], *self.life[k])
                                                 for k in self.running if self.held[k][0] == p],
                            self.local, None if math.isinf(self.kv_cap) else self.kv_cap)
        if go is None:
            return False
        for h in go:
            self.free[p] += self.held.pop(h.key)[1]
            del self.running[h.key]
            a, tokens = self.life.pop(h.key)
            self.local[a] += tokens
            self.held_local[h.key] = (a, tokens)
            self.homes.append(h.key)
        return True

    def take_homes(self) -> list[int]:
        out, self.homes = self.homes, []
        return out

    def finished(self, k: int) -> None:
        held = self.held.pop(k, None)
        if held is not None:
            self.free[held[0]] += held[1]
            self.life.pop(k, None)
            self.running.pop(k, None)
        loc = self.held_local.pop(k, None)
        if loc is not None:
            self.local[loc[0]] -= loc[1]


def kv_link(pool, model, tp_a: int) -> tuple[float, float]:
    """(bytes/s, latency s) between a prefill replica and a decode replica of ``tp_a``
    ranks: the KV stream's, which the offload's messages take too."""
    bw = min(pool.hw.inter_link.bandwidth_Bps * pool.tp_p, model.hw_a.inter_link.bandwidth_Bps * tp_a)
    return bw, max(pool.hw.inter_link.latency_s, model.hw_a.inter_link.latency_s)


class RemoteAttention:
    """One layer's offloaded attention of a decode iteration. Per (decode replica, micro-batch)
    and prefill replica p holding some of its rows: one message up with the rows' q [S, Hq, D],
    k and v [S, Hkv, D] (MLA: q and the new latent, ``kv_elems_override`` elements), one back
    with the output [S, Hq, D], each plus its header and the link latency, at ``bw`` (the KV
    stream's bandwidth); between them p's attention over the rows' cached KV: ``t_attn(S, c) -
    t_attn(S, 0)`` of the pool's layer times (the context part: reading the KV and q.k, p.v;
    the projections stay on the decode side) plus one kernel overhead. A prefill replica runs
    the messages of one micro-batch from every decode replica one after another, and answers
    after the layer of its own prefill step in flight: half a layer's wait on average
    (``Offload.layer_wait``)."""

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

    def one_row_s(self, ctx: float) -> float:
        """One layer's round trip of a single offloaded row at context ``ctx`` on an idle
        prefill replica: both messages on the wire and its attention there."""
        return self.rows_s(1, ctx)

    def rows_s(self, n: float, ctx: float) -> float:
        """One layer's round trip of ``n`` offloaded rows of one micro-batch at mean context
        ``ctx`` on an idle prefill replica (one message each way)."""
        o = self.off
        return (2 * self.lat + (n * (self.up_B + self.down_B) + o.header_up_B + o.header_down_B)
                / self.bw + self.attn_s(n, ctx))

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
