"""CPU torch paths of the MoE kernels against their references, and routing against HF."""
import pytest
import torch

from megainfer.kernels import (RoutingError, fused_moe, fused_moe_ref, moe_align_ref,
                               select_experts, select_experts_ref)


def make_moe(M, E, k, N=16, K=24, dtype=torch.float32, E_global=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    E_global = E_global or E
    hidden = torch.randn(M, K, generator=g).to(dtype)
    w1 = (torch.randn(E, 2 * N, K, generator=g) / K ** 0.5).to(dtype)
    w2 = (torch.randn(E, K, N, generator=g) / N ** 0.5).to(dtype)
    logits = torch.randn(M, E_global, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return hidden, w1, w2, weights, ids


def absent_map(E_global, E_local, seed=0):
    """Every other expert lives here; the rest are absent (-1)."""
    g = torch.Generator().manual_seed(seed)
    here = torch.randperm(E_global, generator=g)[:E_local].sort().values
    emap = torch.full((E_global,), -1, dtype=torch.int32)
    emap[here] = torch.arange(E_local, dtype=torch.int32)
    return emap


@pytest.mark.parametrize("E", [4, 8, 6])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("M", [0, 1, 5, 64])
@pytest.mark.parametrize("absent", [False, True])
def test_torch_path_matches_ref(E, k, M, absent):
    if absent:
        E_l = E // 2
        hidden, w1, w2, w, ids = make_moe(M, E_l, k, E_global=E, seed=M + E)
        emap = absent_map(E, E_l, seed=k)
    else:
        hidden, w1, w2, w, ids = make_moe(M, E, k, seed=M + E)
        emap = None
    out = fused_moe(hidden, w1, w2, w, ids, emap)
    ref = fused_moe_ref(hidden, w1, w2, w, ids, emap)
    assert out.shape == (M, hidden.shape[1]) and out.dtype == hidden.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if absent and M > 0:  # tokens routed only to absent experts get exactly zero
        dead = (emap[ids].long() < 0).all(dim=1)
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))


def test_torch_path_bf16_and_deterministic():
    hidden, w1, w2, w, ids = make_moe(33, 8, 2, dtype=torch.bfloat16)
    out = fused_moe(hidden, w1, w2, w, ids)
    assert out.dtype == torch.bfloat16
    ref = fused_moe_ref(hidden, w1, w2, w, ids)
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)
    assert torch.equal(out, fused_moe(hidden, w1, w2, w, ids))


def test_torch_path_rejects_bad_shapes():
    hidden, w1, w2, w, ids = make_moe(3, 4, 2)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(hidden, w1, w2.transpose(1, 2), w, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(hidden, w1, w2, w[:, :1], ids)


@pytest.mark.parametrize("E,block", [(4, 4), (8, 16), (6, 3)])
def test_moe_align_ref_invariants(E, block):
    g = torch.Generator().manual_seed(E)
    ids = torch.randint(0, E, (37, 2), generator=g)
    emap = absent_map(E, E // 2)
    sorted_ids, block_expert, npad = moe_align_ref(ids, E, block, emap)
    check_align(ids, E, block, emap, sorted_ids, block_expert, npad)


def check_align(ids, E, block, emap, sorted_ids, block_expert, npad):
    """Every slot once, blocks homogeneous and mapped, padding counted right."""
    S = ids.numel()
    flat = ids.reshape(-1)
    npad = int(npad[0])
    counts = torch.bincount(flat, minlength=E)
    assert npad == int(sum(-(-int(c) // block) * block for c in counts))
    assert npad % block == 0 and sorted_ids.numel() >= npad
    used = sorted_ids[:npad].long()
    real = used[used < S]
    assert torch.equal(real.sort().values, torch.arange(S))  # every slot exactly once
    assert (sorted_ids[npad:] == S).all()
    for b in range(npad // block):
        chunk = used[b * block:(b + 1) * block]
        chunk = chunk[chunk < S]
        assert chunk.numel() > 0  # no block is all padding
        experts = flat[chunk].unique()
        assert experts.numel() == 1  # homogeneous
        want = int(experts[0]) if emap is None else int(emap[experts[0]])
        assert int(block_expert[b]) == want
        assert torch.equal(chunk, chunk.sort().values)  # stable within an expert
    assert (block_expert[npad // block:] == -1).all()


# --- routing: our reference against HF's routers, op for op ---------------------------------

def hf_config(cls_name, **kw):
    import transformers
    return getattr(transformers, cls_name)(hidden_size=16, **kw)


@pytest.mark.parametrize("norm", [True, False])
def test_routing_matches_hf_qwen3(norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    cfg = hf_config("Qwen3MoeConfig", num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(11, 16)
    logits, w_hf, ids_hf = router(x)
    w, ids = select_experts(logits, 3, renormalize=norm)
    assert torch.equal(ids, ids_hf) and w.dtype == torch.float32
    torch.testing.assert_close(w, w_hf.float(), rtol=0, atol=0)


def test_routing_matches_hf_mixtral():
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    cfg = hf_config("MixtralConfig", num_local_experts=6, num_experts_per_tok=2)
    router = MixtralTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    logits, w_hf, ids_hf = router(torch.randn(9, 16))
    w, ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(ids, ids_hf)
    torch.testing.assert_close(w, w_hf, rtol=0, atol=0)


@pytest.mark.parametrize("groups,topk_groups,norm", [(4, 2, True), (1, 1, False), (8, 3, True)])
def test_routing_matches_hf_deepseek_v3(groups, topk_groups, norm):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    cfg = hf_config("DeepseekV3Config", n_routed_experts=16, num_experts_per_tok=4,
                    n_group=groups, topk_group=topk_groups, norm_topk_prob=norm,
                    routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_(0, 0.5)
    logits, w_hf, ids_hf = router(torch.randn(13, 16))
    w, ids = select_experts(logits, 4, scoring="sigmoid", renormalize=norm,
                            correction_bias=router.e_score_correction_bias, num_groups=groups,
                            topk_groups=topk_groups, routed_scaling_factor=2.5)
    assert torch.equal(ids, ids_hf)  # same op order, same device: same order
    torch.testing.assert_close(w, w_hf, rtol=0, atol=0)


def test_routing_empty_and_errors():
    w, ids = select_experts(torch.randn(0, 8), 2)
    assert w.shape == (0, 2) and ids.dtype == torch.int64
    with pytest.raises(RoutingError, match="top_k"):
        select_experts_ref(torch.randn(2, 4), 5)
    with pytest.raises(RoutingError, match="num_groups"):
        select_experts_ref(torch.randn(2, 6), 2, scoring="sigmoid", num_groups=4)
    with pytest.raises(RoutingError, match="scoring"):
        select_experts_ref(torch.randn(2, 6), 2, scoring="relu")
