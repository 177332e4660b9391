"""Expert load -> placement of physical expert replicas on expert ranks (EPLB).

Two policies, both vectorised over layers and deterministic (stable sorts, first-index ties):
hierarchical (expert groups packed onto nodes so node loads balance, extra replicas to the
expert with the highest load per replica, then the node's replicas packed onto its ranks
heaviest first) and global (the same with one group and one node, used when groups do not
divide over nodes, or when asked for).

Invariant: physical slot ``p`` lives on rank ``p // (num_replicas // num_ranks)``; ranks are
numbered node-major. docs/eplb.md, "Rebalancing: `rebalance_experts`"."""
from __future__ import annotations

import torch

POLICIES = ("auto", "hierarchical", "global")


class EplbError(ValueError):
    """An EPLB argument has a bad value; the message names the argument."""


def _require(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise EplbError(f"{name}={value!r}: {why}")


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Put n items into ``num_packs`` packs of n/num_packs items each, rows independent.

    Heaviest item first, each into the lightest pack that is not full yet.
    weight: [rows, n] -> (pack [rows, n], position inside the pack [rows, n]).
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:  # one item per pack: nothing to balance
        ids = torch.arange(n).expand(rows, n).clone()
        return ids, torch.zeros_like(ids)
    order = torch.sort(weight, dim=-1, descending=True, stable=True).indices  # [rows, n]
    pack = torch.empty(rows, n, dtype=torch.int64)
    pos = torch.empty(rows, n, dtype=torch.int64)
    load = torch.zeros(rows, num_packs, dtype=torch.float64)     # [rows, packs]
    count = torch.zeros(rows, num_packs, dtype=torch.int64)      # [rows, packs]
    r = torch.arange(rows)
    for i in range(n):
        item = order[:, i]                                        # [rows]
        open_load = load.masked_fill(count >= per_pack, float("inf"))
        p = open_load.argmin(dim=-1)                              # [rows], first lightest
        pack[r, item] = p
        pos[r, item] = count[r, p]
        load[r, p] += weight[r, item]
        count[r, p] += 1
    return _refine_by_swaps(weight, pack, pos, load, num_packs, per_pack)


def _refine_by_swaps(weight, pack, pos, load, num_packs: int, per_pack: int, max_steps: int = 0):
    """Greedy local search after the greedy fill: while some swap of one item of the
    heaviest pack with a lighter item of another pack lowers the larger load of the two,
    make the best such swap (rows independently). Every swap strictly lowers the sum of
    squared pack loads, so this ends; ``max_steps`` (default 4n) bounds it anyway.
    """
    rows, n = weight.shape
    r = torch.arange(rows)
    w = weight.to(torch.float64)
    slot2item = torch.empty(rows, num_packs * per_pack, dtype=torch.int64)   # [rows, n]
    slot2item.scatter_(1, pack * per_pack + pos, torch.arange(n).expand(rows, n).contiguous())
    slot2item = slot2item.view(rows, num_packs, per_pack)                      # [rows, packs, S]
    for _ in range(max_steps or 4 * n):
        h = load.argmax(-1)                                                   # [rows] heaviest pack
        mine = slot2item[r, h]                                                # [rows, S]
        d = w.gather(1, mine).unsqueeze(-1) - w.unsqueeze(1)                  # [rows, S, n]
        other = load.gather(1, pack).unsqueeze(1)                             # [rows, 1, n]
        top = load[r, h].view(rows, 1, 1)
        after = torch.maximum(top - d, other + d)                             # [rows, S, n]
        ok = (d > 0) & (pack != h.unsqueeze(-1)).unsqueeze(1)
        gain = torch.where(ok, top - after, torch.zeros_like(after)).flatten(1)
        best = gain.argmax(-1)                                                # [rows]
        go = gain[r, best] > 1e-12 * top.view(rows).clamp(min=1e-300)         # [rows]
        if not bool(go.any()):
            break
        rr = r[go]
        i = mine[rr, best[go] // n]                                            # item leaving h
        j = best[go] % n                                                       # item coming in
        ph, pj = h[go], pack[rr, j]
        si, sj = pos[rr, i].clone(), pos[rr, j].clone()
        dd = w[rr, i] - w[rr, j]
        load[rr, ph] -= dd
        load[rr, pj] += dd
        pack[rr, i], pack[rr, j] = pj, ph
        pos[rr, i], pos[rr, j] = sj, si
        slot2item[rr, ph, si] = j
        slot2item[rr, pj, sj] = i
    return pack, pos


def replicate(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Spread ``num_phy`` replicas over n experts: each gets one, the extra ones go one
    at a time to the expert with the highest load per replica.

    weight: [rows, n] -> (phy2log [rows, num_phy], logcnt [rows, n]). Replicas 0..n-1 are
    experts 0..n-1; the extra replicas follow in the order they were handed out.
    """
    rows, n = weight.shape
    phy2log = torch.arange(num_phy).expand(rows, num_phy).clone()  # [rows, num_phy]
    logcnt = torch.ones(rows, n, dtype=torch.int64)                # [rows, n]
    r = torch.arange(rows)
    for i in range(n, num_phy):
        e = (weight / logcnt).argmax(dim=-1)                       # [rows], first max
        phy2log[:, i] = e
        logcnt[r, e] += 1
    return phy2log, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of a permutation: [rows, n] -> [rows, n]."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm).contiguous())
    return inv


def _hierarchical(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                  num_ranks: int) -> torch.Tensor:
    """weight [L, N] (float64) -> phy2log [L, R]."""
    L, N = weight.shape
    group_size = N // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = N // num_nodes
    phy_per_node = num_replicas // num_nodes
    ranks_per_node = num_ranks // num_nodes
    slots_per_rank = num_replicas // num_ranks

    # 1. groups -> nodes. node-major order of experts: "node expert" id of each logical expert.
    group_load = weight.view(L, num_groups, group_size).sum(-1)                # [L, G]
    node, pos = balanced_packing(group_load, num_nodes)                         # [L, G] each
    first = (node * groups_per_node + pos) * group_size                         # [L, G]
    log2nlog = (first.unsqueeze(-1) + torch.arange(group_size)).flatten(1)      # [L, N]
    nlog2log = _inverse(log2nlog)                                               # [L, N]

    # 2. replicas inside each node; rows are (layer, node).
    node_load = weight.gather(1, nlog2log).view(L * num_nodes, experts_per_node)
    phy2nlog, cnt = replicate(node_load, phy_per_node)                          # [L*n, P/n], [L*n, E/n]

    # 3. replicas -> ranks of the node, each rank slots_per_rank slots.
    replica_load = (node_load / cnt).gather(1, phy2nlog)                        # [L*n, P/n]
    rank, slot = balanced_packing(replica_load, ranks_per_node)                 # [L*n, P/n] each
    where = rank * slots_per_rank + slot                                        # replica -> slot in node
    slot2nlog = phy2nlog.gather(1, _inverse(where))                             # [L*n, P/n]

    # back to global ids: node n's experts are nlog [n*E/n, (n+1)*E/n).
    offset = (torch.arange(num_nodes) * experts_per_node).view(1, num_nodes, 1)
    slot2nlog = (slot2nlog.view(L, num_nodes, phy_per_node) + offset).flatten(1)  # [L, R]
    return nlog2log.gather(1, slot2nlog)                                        # [L, R]


def phy2log_to_maps(phy2log: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """phy2log [L, R] -> (log2phy [L, N, max_replicas] padded with -1, logcnt [L, N]).

    Replicas of one expert are listed in increasing physical slot order.
    """
    L, R = phy2log.shape
    logcnt = torch.zeros(L, num_experts, dtype=torch.int64).scatter_add_(
        1, phy2log, torch.ones_like(phy2log))                                   # [L, N]
    expert, slot = torch.sort(phy2log, dim=1, stable=True)                      # [L, R] each
    first = logcnt.cumsum(1) - logcnt                                           # [L, N]
    nth = torch.arange(R) - first.gather(1, expert)                             # [L, R]
    log2phy = torch.full((L, num_experts, int(logcnt.max())), -1, dtype=torch.int64)
    log2phy[torch.arange(L).unsqueeze(-1), expert, nth] = slot
    return log2phy, logcnt


def check_arguments(weight, num_replicas: int, num_groups: int, num_nodes: int,
                    num_ranks: int, policy: str = "auto") -> str:
    """Validate; return the policy that will run ('hierarchical' or 'global')."""
    _require(isinstance(weight, torch.Tensor) and weight.dim() == 2, "weight",
             getattr(weight, "shape", type(weight)), "must be a 2-D tensor [layers, logical_experts]")
    _require(weight.shape[0] >= 1 and weight.shape[1] >= 1, "weight", tuple(weight.shape),
             "needs at least one layer and one expert")
    w = weight.double()
    _require(bool(torch.isfinite(w).all()) and bool((w >= 0).all()), "weight", "...",
             "loads must be finite and >= 0")
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups),
                    ("num_nodes", num_nodes), ("num_ranks", num_ranks)):
        _require(isinstance(v, int) and v >= 1, name, v, "must be an integer >= 1")
    N = weight.shape[1]
    _require(policy in POLICIES, "policy", policy, f"must be one of {', '.join(POLICIES)}")
    _require(num_replicas >= N, "num_replicas", num_replicas,
             f"fewer replicas than logical experts ({N})")
    _require(num_replicas % num_ranks == 0, "num_replicas", num_replicas,
             f"must be divisible by num_ranks={num_ranks}")
    _require(N % num_groups == 0, "num_groups", num_groups,
             f"must divide the number of logical experts ({N})")
    _require(num_ranks % num_nodes == 0, "num_ranks", num_ranks,
             f"must be divisible by num_nodes={num_nodes}")
    if policy == "hierarchical":
        _require(num_groups % num_nodes == 0, "num_groups", num_groups,
                 f"must be divisible by num_nodes={num_nodes} for the hierarchical policy")
    if policy == "auto":
        policy = "hierarchical" if num_groups % num_nodes == 0 else "global"
    return policy


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_ranks: int, policy: str = "auto"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [L, N] load of each logical expert -> (phy2log [L, R], log2phy [L, N, X], logcnt [L, N]).

    policy 'auto' runs hierarchical when num_groups divides over num_nodes, else global.
    All outputs are int64 CPU tensors; log2phy is padded with -1 to X = max replica count.
    """
    policy = check_arguments(weight, num_replicas, num_groups, num_nodes, num_ranks, policy)
    w = weight.detach().to("cpu", torch.float64)                               # [L, N]
    if policy == "hierarchical":
        phy2log = _hierarchical(w, num_replicas, num_groups, num_nodes, num_ranks)
    else:
        phy2log = _hierarchical(w, num_replicas, 1, 1, num_ranks)
    if w.shape[1] % num_ranks == 0:
        phy2log = _no_worse_than_contiguous(w, phy2log, num_ranks)
    log2phy, logcnt = phy2log_to_maps(phy2log, w.shape[1])
    return phy2log, log2phy, logcnt


def contiguous_placement(weight: torch.Tensor, num_replicas: int, num_ranks: int) -> torch.Tensor:
    """The identity layout with redundancy: rank r holds experts [r*N/P, (r+1)*N/P) and
    fills its spare slots with more replicas of its own experts (highest load per replica
    first), so every rank's load equals its identity-placement load. [L, N] -> phy2log [L, R].
    """
    L, N = weight.shape
    per_rank, slots = N // num_ranks, num_replicas // num_ranks
    local, _ = replicate(weight.reshape(L * num_ranks, per_rank), slots)        # [L*P, S]
    offset = (torch.arange(num_ranks) * per_rank).view(1, num_ranks, 1)
    return (local.view(L, num_ranks, slots) + offset).flatten(1)                # [L, R]


def _no_worse_than_contiguous(w: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """The greedy packing is a heuristic: on small shapes (e.g. 8 experts on 2 ranks) it
    can end a few percent above the identity layout. Per layer, keep whichever of the two
    has the lower max rank load, so a rebalance never makes the max load worse."""
    base = contiguous_placement(w, phy2log.shape[1], num_ranks)               # [L, R]
    mine = rank_load(w, phy2log, num_ranks).max(-1).values                    # [L]
    ref = rank_load(w, base, num_ranks).max(-1).values                        # [L]
    worse = mine > ref * (1 + 1e-12)                                          # [L]
    return torch.where(worse.unsqueeze(-1), base, phy2log)


def rank_load(weight: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Expected load of each rank when replicas split their expert's load evenly.

    weight [L, N], phy2log [L, R] -> [L, num_ranks] (float64).
    """
    w = weight.to(torch.float64)
    L, N = w.shape
    cnt = torch.zeros(L, N, dtype=torch.float64).scatter_add_(
        1, phy2log, torch.ones_like(phy2log, dtype=torch.float64))            # [L, N]
    per_replica = (w / cnt.clamp(min=1)).gather(1, phy2log)                    # [L, R]
    return per_replica.view(L, num_ranks, -1).sum(-1)                          # [L, ranks]


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """max/mean over ranks, per layer: [L, ranks] -> [L] (1.0 = perfect; 1.0 for all-zero)."""
    mean = load.mean(-1)
    return torch.where(mean > 0, load.max(-1).values / mean.clamp(min=1e-300), torch.ones_like(mean))
