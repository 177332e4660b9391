"""rebalance_experts: invariants on random loads, never worse than identity, errors."""
from types import SimpleNamespace

import pytest
import torch

from megainfer.eplb.placement_policy import (EplbError, contiguous_placement, imbalance, rank_load,
                                      rebalance_experts)

# (layers, experts, replicas, groups, nodes, ranks)
SHAPES = [
    (1, 8, 8, 1, 1, 2),     # tiny model, no redundancy
    (3, 8, 10, 1, 1, 2),    # tiny model, 2 redundant slots
    (2, 6, 6, 1, 1, 3),
    (3, 6, 8, 2, 2, 2),     # experts not a power of 2, hierarchical over 2 nodes
    (2, 12, 16, 4, 2, 4),
    (2, 12, 12, 3, 1, 4),
    (4, 12, 18, 3, 3, 3),   # 3 nodes, 1 rank each
    (2, 12, 16, 3, 2, 4),   # groups do not divide over nodes: auto -> global
    (2, 16, 24, 4, 2, 8),
]
SEEDS = range(4)


def loads(kind: str, L: int, N: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        return torch.rand(L, N, generator=g)
    if kind == "skewed":
        return torch.rand(L, N, generator=g) ** 6 * 1000
    if kind == "counts":  # integer token counts, zeros included
        return torch.randint(0, 40, (L, N), generator=g)
    ranks = torch.stack([torch.randperm(N, generator=g) for _ in range(L)]) + 1  # zipf
    return 1.0 / ranks.double() ** 1.2


def check_consistent(phy2log, log2phy, logcnt, L, N, R):
    assert phy2log.shape == (L, R) and logcnt.shape == (L, N)
    assert log2phy.shape[:2] == (L, N) and log2phy.shape[2] == int(logcnt.max())
    assert bool((logcnt >= 1).all()), "an expert has no replica"
    assert torch.equal(logcnt.sum(-1), torch.full((L,), R))
    for l in range(L):
        assert torch.equal(torch.bincount(phy2log[l], minlength=N), logcnt[l])
        seen = []
        for e in range(N):
            row = log2phy[l, e].tolist()
            c = int(logcnt[l, e])
            assert all(p == -1 for p in row[c:]) and all(p >= 0 for p in row[:c])
            assert row[:c] == sorted(row[:c])
            assert all(int(phy2log[l, p]) == e for p in row[:c])
            seen += row[:c]
        assert sorted(seen) == list(range(R))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["uniform", "skewed", "counts", "zipf"])
def test_invariants_and_never_worse_than_identity(shape, kind):
    L, N, R, G, Nn, P = shape
    for seed in SEEDS:
        w = loads(kind, L, N, seed)
        phy2log, log2phy, logcnt = rebalance_experts(w, R, G, Nn, P)
        check_consistent(phy2log, log2phy, logcnt, L, N, R)
        mine = rank_load(w, phy2log, P)                                 # [L, P]
        assert torch.allclose(mine.sum(-1), w.double().sum(-1))         # no load lost
        if N % P == 0:
            ident = rank_load(w, torch.arange(N).expand(L, N), P)
            assert bool((imbalance(mine) <= imbalance(ident) * (1 + 1e-9)).all()), (seed, kind)


def test_rank_load_matches_loop_reference():
    w = loads("skewed", 2, 12, 7)
    phy2log, _, logcnt = rebalance_experts(w, 16, 4, 2, 4)
    for l in range(2):
        ref = [0.0] * 4
        for p in range(16):
            e = int(phy2log[l, p])
            ref[p // 4] += float(w[l, e]) / int(logcnt[l, e])
        assert torch.allclose(rank_load(w, phy2log, 4)[l], torch.tensor(ref, dtype=torch.float64))


def test_hand_example_hot_expert():
    # one hot expert: it gets both redundant slots; 5 slots per rank.
    w = torch.tensor([[10.0, 1, 1, 1, 1, 1, 1, 1]])
    phy2log, log2phy, logcnt = rebalance_experts(w, 10, 1, 1, 2)
    assert logcnt.tolist() == [[3, 1, 1, 1, 1, 1, 1, 1]]
    load = rank_load(w, phy2log, 2)[0]
    # best split of {10/3 x3, 1 x7} into 5+5 slots: {10/3, 10/3, 1, 1, 1} and {10/3, 1, 1, 1, 1}
    assert torch.allclose(load.max(), torch.tensor(20 / 3 + 3, dtype=torch.float64))
    assert float(imbalance(rank_load(w, torch.arange(8).unsqueeze(0), 2))[0]) == pytest.approx(13 / 8.5)


def test_hierarchical_keeps_groups_on_nodes():
    L, N, R, G, Nn, P = 3, 12, 18, 4, 2, 6
    w = loads("skewed", L, N, 3)
    phy2log, _, _ = rebalance_experts(w, R, G, Nn, P, policy="hierarchical")
    per_node = R // Nn
    for l in range(L):
        node_groups = [set(int(e) // (N // G) for e in phy2log[l, n * per_node:(n + 1) * per_node])
                       for n in range(Nn)]
        assert all(len(s) == G // Nn for s in node_groups)           # each node: G/Nn groups
        assert set.union(*node_groups) == set(range(G))
        assert sum(len(s) for s in node_groups) == G                 # no group split over nodes
        # group packing balances node loads: the two heaviest groups land on different nodes
        gl = w[l].view(G, -1).sum(-1)
        top2 = gl.argsort(descending=True)[:2].tolist()
        assert not any(top2[0] in s and top2[1] in s for s in node_groups)


def test_auto_picks_global_when_groups_do_not_divide_over_nodes():
    w = loads("zipf", 2, 12, 1)
    auto = rebalance_experts(w, 16, 3, 2, 4)
    glob = rebalance_experts(w, 16, 3, 2, 4, policy="global")
    assert all(torch.equal(a, b) for a, b in zip(auto, glob))
    hier = rebalance_experts(w, 16, 4, 2, 4)
    assert all(torch.equal(a, b) for a, b in zip(hier, rebalance_experts(w, 16, 4, 2, 4, "hierarchical")))


def test_global_spreads_better_than_hierarchical_on_a_hot_group():
    # group 0 is hot; hierarchical must keep it on one node, global may spread it.
    w = torch.tensor([[50.0, 40, 30, 20, 1, 1, 1, 1]])
    hier = rebalance_experts(w, 8, 2, 2, 4, policy="hierarchical")[0]
    glob = rebalance_experts(w, 8, 2, 2, 4, policy="global")[0]
    assert float(rank_load(w, glob, 4).max()) < float(rank_load(w, hier, 4).max())


def test_deterministic_and_input_untouched():
    w = loads("counts", 3, 12, 5)
    keep = w.clone()
    a = rebalance_experts(w, 18, 3, 3, 3)
    b = rebalance_experts(w, 18, 3, 3, 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(w, keep)


def test_all_zero_load_is_valid():
    phy2log, log2phy, logcnt = rebalance_experts(torch.zeros(2, 6), 8, 1, 1, 2)
    check_consistent(phy2log, log2phy, logcnt, 2, 6, 8)


def test_contiguous_placement_matches_identity_loads():
    w = loads("skewed", 2, 8, 2)
    base = contiguous_placement(w.double(), 10, 2)
    assert torch.allclose(rank_load(w, base, 2), rank_load(w, torch.arange(8).expand(2, 8), 2))
    assert all(set(base[l, :5].tolist()) == {0, 1, 2, 3} for l in range(2))


def test_realistic_shape_is_balanced():
    # DeepSeek-V3-like: 58 MoE layers x 256 experts (8 groups), 4 nodes x 8 ranks, 288 slots.
    w = loads("zipf", 58, 256, 0) * 1e4
    phy2log, log2phy, logcnt = rebalance_experts(w, 288, 8, 4, 32)
    assert phy2log.shape == (58, 288) and bool((logcnt >= 1).all())
    assert torch.equal(logcnt.sum(-1), torch.full((58,), 288))
    glob = rebalance_experts(w, 288, 1, 1, 32)[0]
    assert float(imbalance(rank_load(w, glob, 32)).max()) < 1.25
    ident = imbalance(rank_load(w, torch.arange(256).expand(58, 256), 32))
    assert bool((imbalance(rank_load(w, phy2log, 32)) < ident).all())


@pytest.mark.parametrize("args,name", [
    ((10, 1, 1, 4), "num_replicas"),            # not divisible by ranks
    ((6, 1, 1, 2), "num_replicas"),             # fewer replicas than experts
    ((8, 3, 1, 2), "num_groups"),               # 8 experts not divisible by 3 groups
    ((8, 4, 2, 3), "num_replicas"),             # 8 % 3
    ((12, 4, 3, 4), "num_ranks"),               # ranks not divisible by nodes
    ((8, 0, 1, 2), "num_groups"),
    ((8, 1, 1, 0), "num_ranks"),
])
def test_invalid_arguments(args, name):
    with pytest.raises(EplbError, match=name):
        rebalance_experts(torch.rand(2, 8), *args)


def test_invalid_hierarchical_and_weights():
    w = torch.rand(2, 12)
    with pytest.raises(EplbError, match="num_groups"):
        rebalance_experts(w, 12, 3, 2, 4, policy="hierarchical")
    with pytest.raises(EplbError, match="policy"):
        rebalance_experts(w, 12, 3, 2, 4, policy="fancy")
    with pytest.raises(EplbError, match="weight"):
        rebalance_experts(torch.rand(12), 12, 1, 1, 4)
    with pytest.raises(EplbError, match="weight"):
        rebalance_experts(-w, 12, 1, 1, 4)
    with pytest.raises(EplbError, match="weight"):
        rebalance_experts(torch.full((2, 12), float("nan")), 12, 1, 1, 4)
    assert issubclass(EplbError, ValueError)


def test_eplb_groups_default_to_the_models_routing_groups():
    from megainfer.config import ConfigError, EplbConfig, ModelConfig
    base = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=16)
    mixtral = ModelConfig(family="mixtral", **base)
    assert EplbConfig().groups_for(mixtral) == 1
    assert EplbConfig(num_groups=2).groups_for(mixtral) == 2
    grouped = SimpleNamespace(n_group=4)  # what a DeepSeek config carries
    assert EplbConfig().groups_for(grouped) == 4 and EplbConfig(num_groups=1).groups_for(grouped) == 1
    with pytest.raises(ConfigError, match="eplb.num_groups=0"):
        EplbConfig(num_groups=0)
