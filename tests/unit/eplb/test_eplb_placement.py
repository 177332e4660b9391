"""Placement: expert maps, token-side replica choice, weight move lists."""
from collections import Counter

import pytest
import torch

from megainfer.eplb.placement import Placement, PlacementError, weight_moves, weight_sends
from megainfer.eplb.placement_policy import phy2log_to_maps, rebalance_experts


def random_topk(M: int, k: int, N: int, seed: int, hot: int = 0) -> torch.Tensor:
    """[M, k] distinct experts per row; a bias makes the first `hot` experts popular."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(M, N, generator=g)
    logits[:, :hot] += 0.7
    return logits.topk(k, dim=-1).indices


def skewed_placement(L=3, N=12, R=16, P=4, seed=0, G=4, Nn=2) -> Placement:
    g = torch.Generator().manual_seed(seed)
    return Placement.from_rebalance(torch.rand(L, N, generator=g) ** 5, R, G, Nn, P)


def test_identity():
    pl = Placement.identity(2, 8, 2)
    assert pl.slots_per_rank == 4 and list(pl.slots_of_rank(1)) == [4, 5, 6, 7]
    assert pl.local_experts(1).tolist() == [[4, 5, 6, 7]] * 2
    assert pl.logcnt.tolist() == [[1] * 8] * 2
    ids = random_topk(5, 2, 8, 0)
    assert torch.equal(pl.choose_replicas(1, ids), ids)  # no redundancy: slot == expert


def test_from_rebalance_matches_rebalance_experts():
    w = torch.rand(3, 12, generator=torch.Generator().manual_seed(1))
    pl = Placement.from_rebalance(w, 18, 3, 3, 3)
    phy2log, log2phy, logcnt = rebalance_experts(w, 18, 3, 3, 3)
    assert torch.equal(pl.phy2log, phy2log) and torch.equal(pl.log2phy, log2phy)
    assert torch.equal(pl.logcnt, logcnt) and pl.num_ranks == 3 and pl.slots_per_rank == 6


def test_expert_map_covers_every_slot_once():
    pl = skewed_placement()
    maps = [pl.expert_map(r) for r in range(4)]
    assert all(m.dtype == torch.int32 and m.shape == (16,) for m in maps)
    owners = torch.stack([m >= 0 for m in maps]).sum(0)
    assert bool((owners == 1).all())
    for r, m in enumerate(maps):
        for p in range(16):
            assert int(m[p]) == (p - 4 * r if 4 * r <= p < 4 * r + 4 else -1)
        # local index i on rank r holds the expert phy2log says for slot r*S + i
        assert torch.equal(pl.local_experts(r), pl.phy2log[:, 4 * r:4 * r + 4])
    assert pl.rank_of_slot(torch.tensor([0, 3, 4, 15])).tolist() == [0, 0, 1, 3]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_choose_replicas_is_correct_balanced_and_deterministic(seed, offset):
    pl = skewed_placement(seed=seed)
    assert int(pl.logcnt.max()) >= 2  # the test needs redundancy
    for layer in range(pl.num_layers):
        ids = random_topk(37, 3, 12, seed * 10 + layer, hot=3)                 # [M, k]
        phys = pl.choose_replicas(layer, ids, offset=offset)                   # [M, k]
        assert phys.shape == ids.shape
        assert torch.equal(pl.phy2log[layer][phys], ids)                       # right expert
        assert torch.equal(phys, pl.choose_replicas(layer, ids.clone(), offset=offset))
        per_slot = Counter(phys.flatten().tolist())
        per_expert = Counter(ids.flatten().tolist())
        for e, n in per_expert.items():
            c = int(pl.logcnt[layer, e])
            got = [per_slot.get(int(p), 0) for p in pl.log2phy[layer, e, :c]]
            assert sum(got) == n and max(got) - min(got) <= 1, (e, got)
        # reference: n-th occurrence (row-major) of e -> replica (n + offset) % c
        seen = Counter()
        for t, e in enumerate(ids.flatten().tolist()):
            c = int(pl.logcnt[layer, e])
            assert int(phys.flatten()[t]) == int(pl.log2phy[layer, e, (seen[e] + offset) % c])
            seen[e] += 1


def test_choose_replicas_empty_batch():
    pl = skewed_placement()
    out = pl.choose_replicas(0, torch.empty(0, 2, dtype=torch.int64))
    assert out.shape == (0, 2)


def test_placement_rejects_inconsistent_maps():
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 1]])
    log2phy, logcnt = phy2log_to_maps(phy2log, 4)
    Placement(phy2log, log2phy, logcnt, 3)  # fine
    with pytest.raises(PlacementError, match="num_ranks"):
        Placement(phy2log, log2phy, logcnt, 4)
    with pytest.raises(PlacementError, match="logcnt"):
        Placement(phy2log, log2phy, logcnt + 1, 3)
    bad = log2phy.clone()
    bad[0, 0, 0], bad[0, 0, 1] = bad[0, 0, 1], bad[0, 0, 0]
    with pytest.raises(PlacementError, match="log2phy"):
        Placement(phy2log, bad, logcnt, 3)
    with pytest.raises(PlacementError, match="replica"):  # expert 3 missing
        Placement.from_phy2log(torch.tensor([[0, 1, 2, 0]]), 4, 2)
    with pytest.raises(PlacementError, match="layer"):
        Placement(phy2log, log2phy, logcnt, 3).choose_replicas(1, torch.zeros(1, 1, dtype=torch.int64))


def apply_moves(old: Placement, new: Placement):
    """Simulate the runtime: each rank stages new buffers from old ones via the move list.
    A 'weight' is (layer, expert) so a wrong copy is visible."""
    P = old.num_ranks
    buf = [[[(l, int(e)) for e in old.local_experts(r)[l]] for l in range(old.num_layers)]
           for r in range(P)]
    out = []
    for r in range(P):
        staged = [list(row) for row in buf[r]]
        for m in weight_moves(old, new, r):
            src = r if m.src == "self" else m.src
            assert m.rank == r and (m.src == "self" or m.src != r)
            assert buf[src][m.layer][m.src_slot] == (m.layer, m.expert)  # the source holds it
            staged[m.layer][m.dst_slot] = buf[src][m.layer][m.src_slot]
        out.append(staged)
    return out


@pytest.mark.parametrize("seeds", [(0, 1), (2, 3), (4, 4)])
def test_moves_give_every_slot_its_new_expert(seeds):
    old = skewed_placement(seed=seeds[0])
    new = skewed_placement(seed=seeds[1])
    after = apply_moves(old, new)
    for r in range(new.num_ranks):
        for l in range(new.num_layers):
            assert after[r][l] == [(l, int(e)) for e in new.local_experts(r)[l]]
    changed = int((old.phy2log != new.phy2log).sum())
    assert sum(len(weight_moves(old, new, r)) for r in range(4)) == changed
    if seeds[0] == seeds[1]:
        assert changed == 0
    # the send lists are exactly the remote receive lists
    recv = sorted(m for r in range(4) for m in weight_moves(old, new, r) if m.src != "self")
    sent = sorted(m for r in range(4) for m in weight_sends(old, new, r))
    assert recv == sent


def test_moves_from_identity_to_redundant_layout():
    # identity (8 slots) cannot become a 10-slot layout: slot counts must match
    with pytest.raises(PlacementError, match="num_replicas"):
        weight_moves(Placement.identity(1, 8, 2), skewed_placement(1, 8, 10, 2, G=1, Nn=1), 0)
    old = Placement.from_phy2log(torch.tensor([[0, 1, 2, 3, 0, 4, 5, 6, 7, 4]]), 8, 2)
    new = Placement.from_phy2log(torch.tensor([[7, 0, 2, 3, 1, 4, 5, 6, 0, 0]]), 8, 2)
    # rank 0: slot 0 gets 7 from rank 1 slot 3; slots 1 and 4 copy locally from old slots 0, 1
    assert weight_moves(old, new, 0) == [(0, 0, 7, 1, 3, 0), (0, 1, 0, "self", 0, 0),
                                         (0, 4, 1, "self", 1, 0)]
    moves1 = weight_moves(old, new, 1)  # expert 0 into slots 3, 4 from rank 0's slot 0
    assert [(m.dst_slot, m.expert, m.src, m.src_slot) for m in moves1] == [(3, 0, 0, 0), (4, 0, 0, 0)]
    assert weight_sends(old, new, 0) == moves1
    assert weight_sends(old, new, 1) == [weight_moves(old, new, 0)[0]]
