"""Which requests' decode attention is offloaded to their prefill rank (``pd.offload``): the one
rule that rank 0's ledger (``runtime/pd/offload_policy.py``) and the PD simulator's book
(``perfmodel/sim/pd_offload.py``) both apply, at hand-out.

``pd.offload_policy=ratio``: the k-th eligible request when the fixed fraction says so
(``floor((k + 1) r) > floor(k r)``, ``picks_by_ratio``) and its prefill rank's pool has room for
its whole life. ``auto`` (``picks_auto``): only while (1) that pool has room, (2) the decode
replica's KV is under pressure: the request's whole life does not fit beside the local requests
already given to that replica (it would otherwise wait or be preempted), and (3) where a TPOT
SLO and a prediction are given, the predicted TPOT with the extra round trip stays within it.
A request chosen whose pool is short sends requests decoding from that pool home
(``homes_for_room``).
docs/pd.md, "Decode attention offloaded to the prefill ranks".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


def picks_by_ratio(k: int, ratio: float) -> bool:
    """Whether the k-th eligible request (from 0) is chosen by the fixed fraction ``ratio``."""
    return math.floor((k + 1) * ratio) > math.floor(k * ratio)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that hold ``tokens``."""
    return -(-int(tokens) // block_size)


@dataclass(frozen=True)
class OffloadCandidate:
    """One request at hand-out, as ``picks_auto`` sees it (tokens are whole-life KV tokens)."""

    need_blocks: int  # its whole life in its prefill rank's pool blocks
    pool_free_blocks: int  # that pool's blocks not promised to other requests
    need_tokens: int  # its whole life in the decode replica's KV
    decode_free_tokens: int  # the decode replica's KV not reserved by its local requests
    tpot_s: Optional[float] = None  # the predicted TPOT with it offloaded (None: no prediction)
    tpot_slo_s: Optional[float] = None  # the TPOT SLO (None: none set)


def picks_auto(c: OffloadCandidate) -> bool:
    """``auto``: offload when the pool has room, the decode replica's KV would not hold the
    request, and the predicted TPOT (where there is one and an SLO) stays within the SLO."""
    if c.need_blocks > c.pool_free_blocks:
        return False
    if c.need_tokens <= c.decode_free_tokens:  # no pressure: it decodes locally without waiting
        return False
    return c.tpot_s is None or c.tpot_slo_s is None or c.tpot_s <= c.tpot_slo_s


@dataclass(frozen=True)
class Decoding:
    """An offloaded request decoding from a pool, as ``homes_for_room`` sees it."""

    key: object  # the caller's id of it
    pool_blocks: int  # its blocks in that pool
    replica: int  # its decode replica
    tokens: int  # its whole life in that replica's KV


def homes_for_room(need: int, pool_free: int, decoding: list, local_tokens: list,
                   kv_cap: Optional[float]) -> Optional[list]:
    """The requests of ``decoding`` (oldest first) to send home so that ``need`` blocks of their
    pool are free, each only while its decode replica's KV (``kv_cap`` tokens; None: unlimited)
    holds its whole life beside ``local_tokens`` (per replica) and the ones before it; None when
    that many cannot be freed (nothing is sent then)."""
    free, room, go = pool_free, list(local_tokens), []
    for d in decoding:
        if free >= need:
            break
        if kv_cap is None or room[d.replica] + d.tokens <= kv_cap:
            room[d.replica] += d.tokens
            free += d.pool_blocks
            go.append(d)
    return go if free >= need else None
