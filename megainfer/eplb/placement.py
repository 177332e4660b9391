"""Placement: where each physical expert slot lives, and how tokens pick a replica.

Physical slots are split contiguously over expert ranks: rank r holds slots
[r*S, (r+1)*S) with S = num_replicas // num_ranks, the same split on every layer; what
changes between placements is which logical expert each slot holds (``phy2log``).
"""
from __future__ import annotations

from typing import NamedTuple, Union

import torch

from megainfer.eplb.placement_policy import EplbError, phy2log_to_maps, rebalance_experts


class PlacementError(EplbError):
    """A placement (or a pair of placements) is inconsistent; the message names what."""


def _require(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise PlacementError(f"{name}={value!r}: {why}")


class Move(NamedTuple):
    """One expert weight copy into ``rank``'s local slot ``dst_slot`` of ``layer``.

    ``src`` is the rank that holds ``expert`` in the old placement, or 'self' when ``rank``
    itself held it (then ``src_slot`` is the old local slot to copy from).
    """
    layer: int
    dst_slot: int
    expert: int
    src: Union[int, str]
    src_slot: int
    rank: int


class Placement:
    """phy2log [L, R], log2phy [L, N, X] (-1 padded), logcnt [L, N] over ``num_ranks`` ranks."""

    def __init__(self, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor,
                 num_ranks: int):
        _require(phy2log.dim() == 2, "phy2log.shape", tuple(phy2log.shape), "must be [layers, replicas]")
        L, R = phy2log.shape
        _require(isinstance(num_ranks, int) and num_ranks >= 1 and R % num_ranks == 0,
                 "num_ranks", num_ranks, f"must be >= 1 and divide num_replicas={R}")
        _require(logcnt.dim() == 2 and logcnt.shape[0] == L, "logcnt.shape", tuple(logcnt.shape),
                 f"must be [{L}, experts]")
        N = logcnt.shape[1]
        _require(bool(((phy2log >= 0) & (phy2log < N)).all()), "phy2log", "...",
                 f"holds ids outside [0, {N})")
        ref_l2p, ref_cnt = phy2log_to_maps(phy2log.long().cpu(), N)
        _require(torch.equal(ref_cnt, logcnt.long().cpu()), "logcnt", "...",
                 "does not count phy2log's replicas (or an expert has none)")
        _require(bool((ref_cnt >= 1).all()), "phy2log", "...", "some logical expert has no replica")
        l2p = log2phy.long().cpu()
        _require(l2p.dim() == 3 and l2p.shape[:2] == (L, N) and l2p.shape[2] >= ref_l2p.shape[2],
                 "log2phy.shape", tuple(log2phy.shape), f"must be [{L}, {N}, >= max replicas]")
        _require(torch.equal(l2p[..., :ref_l2p.shape[2]], ref_l2p) and
                 bool((l2p[..., ref_l2p.shape[2]:] == -1).all()), "log2phy", "...",
                 "does not list phy2log's slots in increasing order, padded with -1")
        self.phy2log = phy2log.long().cpu()                     # [L, R]
        self.log2phy = ref_l2p                                  # [L, N, X]
        self.logcnt = ref_cnt                                   # [L, N]
        self.num_ranks = num_ranks
        self.num_layers, self.num_replicas, self.num_experts = L, R, N
        self.slots_per_rank = R // num_ranks
        self._on_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_ranks: int) -> "Placement":
        """No redundancy: slot e holds expert e, rank r experts [r*N/P, (r+1)*N/P)."""
        phy2log = torch.arange(num_experts).expand(num_layers, num_experts).clone()
        return cls.from_phy2log(phy2log, num_experts, num_ranks)

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_experts: int, num_ranks: int) -> "Placement":
        log2phy, logcnt = phy2log_to_maps(phy2log.long(), num_experts)
        return cls(phy2log, log2phy, logcnt, num_ranks)

    @classmethod
    def from_rebalance(cls, weight: torch.Tensor, num_replicas: int, num_groups: int,
                       num_nodes: int, num_ranks: int, policy: str = "auto") -> "Placement":
        phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes,
                                                     num_ranks, policy)
        return cls(phy2log, log2phy, logcnt, num_ranks)

    # -- expert side ---------------------------------------------------------------------
    def slots_of_rank(self, rank: int) -> range:
        _require(0 <= rank < self.num_ranks, "rank", rank, f"must be in [0, {self.num_ranks})")
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def local_experts(self, rank: int) -> torch.Tensor:
        """Logical expert held by each local slot of ``rank``: [L, S]."""
        s = self.slots_of_rank(rank)
        return self.phy2log[:, s.start:s.stop]

    def expert_map(self, rank: int) -> torch.Tensor:
        """Global physical slot -> local index on ``rank`` (-1 if not there): int32 [R].

        The same for every layer, since the slot split does not depend on the layer.
        """
        s = self.slots_of_rank(rank)
        out = torch.full((self.num_replicas,), -1, dtype=torch.int32)
        out[s.start:s.stop] = torch.arange(self.slots_per_rank, dtype=torch.int32)
        return out

    def rank_of_slot(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.div(slots, self.slots_per_rank, rounding_mode="floor")

    # -- attention side ------------------------------------------------------------------
    def choose_replicas(self, layer: int, topk_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Logical expert ids [M, k] -> physical slot ids [M, k].

        The n-th occurrence (row-major) of expert e in the batch goes to replica
        (n + offset) mod logcnt[e], so within one batch every replica of e gets
        floor or ceil of (count / logcnt[e]) tokens. Depends only on the batch and
        ``offset`` (e.g. the attention replica id, to stagger the +1s across senders).
        """
        _require(0 <= layer < self.num_layers, "layer", layer, f"must be in [0, {self.num_layers})")
        dev = topk_ids.device
        flat = topk_ids.reshape(-1).long()                                  # [M*k]
        log2phy, logcnt = self._tables(dev)
        l2p, cnt = log2phy[layer], logcnt[layer]                            # [N, X], [N]
        n = flat.numel()
        expert, order = torch.sort(flat, stable=True)                       # [M*k] each
        per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=dev)
        per_expert.index_add_(0, flat, torch.ones_like(flat))               # [N]
        first = per_expert.cumsum(0) - per_expert                           # [N]
        nth = torch.empty_like(flat)
        nth[order] = torch.arange(n, device=dev) - first[expert]            # occurrence index
        replica = (nth + offset) % cnt[flat]                                # [M*k]
        return l2p[flat, replica].view(topk_ids.shape)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """log2phy and logcnt on ``device``, copied once (no copy per call on the GPU path)."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = (self.log2phy.to(device), self.logcnt.to(device))
        return self._on_device[key]

    def __eq__(self, other) -> bool:
        return (isinstance(other, Placement) and self.num_ranks == other.num_ranks
                and torch.equal(self.phy2log, other.phy2log))

    def __repr__(self) -> str:
        return (f"Placement(layers={self.num_layers}, experts={self.num_experts}, "
                f"replicas={self.num_replicas}, ranks={self.num_ranks})")


def _check_pair(old: Placement, new: Placement) -> None:
    for name in ("num_layers", "num_experts", "num_replicas", "num_ranks"):
        a, b = getattr(old, name), getattr(new, name)
        _require(a == b, f"new.{name}", b, f"differs from the old placement's {a}")


def _holders(old: Placement, layer: int, expert: int) -> list[tuple[int, int]]:
    """(rank, local slot) of each old replica of ``expert``, one per rank, rank order."""
    seen: dict[int, int] = {}
    for p in old.log2phy[layer, expert].tolist():
        if p >= 0 and p // old.slots_per_rank not in seen:
            seen[p // old.slots_per_rank] = p % old.slots_per_rank
    return sorted(seen.items())


def weight_moves(old: Placement, new: Placement, rank: int) -> list[Move]:
    """Copies ``rank`` must receive to go from ``old`` to ``new``, (layer, dst_slot) order.

    A slot that already holds its new expert needs nothing. Otherwise the copy comes from
    ``rank`` itself if it held the expert anywhere ('self'), else from one old holder,
    chosen as holders[rank mod len(holders)] so the senders of one expert take turns.
    Local copies must read the *old* weights (stage into fresh buffers, then swap).
    """
    _check_pair(old, new)
    old.slots_of_rank(rank)  # validates rank
    before = old.local_experts(rank).tolist()                # [L][S]
    after = new.local_experts(rank).tolist()                 # [L][S]
    moves = []
    for layer in range(new.num_layers):
        for slot, e in enumerate(after[layer]):
            if before[layer][slot] == e:
                continue
            if e in before[layer]:
                moves.append(Move(layer, slot, e, "self", before[layer].index(e), rank))
                continue
            holders = _holders(old, layer, e)
            assert holders and all(r != rank for r, _ in holders), holders
            src, src_slot = holders[rank % len(holders)]
            moves.append(Move(layer, slot, e, src, src_slot, rank))
    return moves


def weight_sends(old: Placement, new: Placement, rank: int) -> list[Move]:
    """The moves other ranks receive from ``rank`` (its side of the point-to-point copies),
    ordered by (destination rank, layer, dst_slot)."""
    _check_pair(old, new)
    return [m for r in range(new.num_ranks) if r != rank
            for m in weight_moves(old, new, r) if m.src == rank]
