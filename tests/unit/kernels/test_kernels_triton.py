"""Triton kernels (run by the interpreter, TRITON_INTERPRET=1) against their torch references."""
import os

import pytest
import torch

from megainfer.kernels import (fused_moe, fused_moe_ref, moe_align, moe_align_ref,
                               select_experts, select_experts_ref)
from test_kernels_torch import absent_map, check_align, make_moe

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton needs a GPU or TRITON_INTERPRET=1")
N, K = 32, 64  # small: the interpreter runs every program in numpy
# compiled for real on a GPU (TRITON_INTERPRET unset or 0): inputs are built on the CPU, moved
# to the GPU for the Triton call, and the outputs come back to be compared with the references
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def dev(fn, *args, **kwargs):
    """fn on DEVICE: tensor arguments moved there, tensor results moved back to the CPU."""
    to = lambda x: x.to(DEVICE) if isinstance(x, torch.Tensor) else x  # noqa: E731
    out = fn(*[to(a) for a in args], **{k: to(v) for k, v in kwargs.items()})
    back = lambda x: x.cpu() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return tuple(back(x) for x in out) if isinstance(out, tuple) else back(out)


def case(M, E, k, absent, dtype=torch.float32, n=N, kk=K):
    if absent:
        hidden, w1, w2, w, ids = make_moe(M, E // 2, k, N=n, K=kk, dtype=dtype, E_global=E,
                                          seed=M * 7 + E)
        return hidden, w1, w2, w, ids, absent_map(E, E // 2, seed=k)
    return (*make_moe(M, E, k, N=n, K=kk, dtype=dtype, seed=M * 7 + E), None)


GRID = [(E, k, M, a) for E in (4, 8, 6) for k in (1, 2, 3) for M in (0, 1, 5, 64)
        for a in (False, True) if M < 64 or E == 4]


@pytest.mark.parametrize("E,k,M,absent", GRID)
def test_fused_moe_triton_matches_ref(E, k, M, absent):
    hidden, w1, w2, w, ids, emap = case(M, E, k, absent)
    out = dev(fused_moe, hidden, w1, w2, w, ids, emap, backend="triton")
    ref = fused_moe_ref(hidden, w1, w2, w, ids, emap)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fused_moe_triton_ragged_shapes_and_all_absent():
    """N, K not multiples of the block; then a rank holding none of the routed experts."""
    hidden, w1, w2, w, ids, emap = case(9, 6, 2, True, n=40, kk=48)
    out = dev(fused_moe, hidden, w1, w2, w, ids, emap, backend="triton")
    torch.testing.assert_close(out, fused_moe_ref(hidden, w1, w2, w, ids, emap),
                               rtol=1e-5, atol=1e-5)
    none_here = torch.full_like(emap, -1)
    out = dev(fused_moe, hidden, w1, w2, w, ids, none_here, backend="triton")
    assert torch.equal(out, torch.zeros_like(out))


def test_fused_moe_triton_bf16_and_deterministic():
    hidden, w1, w2, w, ids, emap = case(37, 8, 2, False, dtype=torch.bfloat16)
    out = dev(fused_moe, hidden, w1, w2, w, ids, emap, backend="triton")
    assert out.dtype == torch.bfloat16
    ref = fused_moe_ref(hidden, w1, w2, w, ids, emap)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(out, dev(fused_moe, hidden, w1, w2, w, ids, emap, backend="triton"))


@pytest.mark.parametrize("E", [4, 8, 6])
@pytest.mark.parametrize("M", [0, 1, 5, 64])
@pytest.mark.parametrize("block", [4, 32])
@pytest.mark.parametrize("mapped", [False, True])
def test_moe_align_triton_matches_ref(E, M, block, mapped):
    g = torch.Generator().manual_seed(M * 13 + E + block)
    k = 1 + (M + E) % 3
    ids = torch.randint(0, E, (M, k), generator=g)
    emap = absent_map(E, E // 2, seed=M) if mapped else None
    got = dev(moe_align, ids, E, block, emap, backend="triton")
    want = moe_align_ref(ids, E, block, emap)
    for a, b, name in zip(got, want, ("sorted_ids", "block_expert", "num_padded")):
        assert torch.equal(a, b), name
    check_align(ids, E, block, emap, *got)


def test_moe_align_triton_random_invariants():
    """Skewed random routings over many slot chunks (several scatter programs)."""
    g = torch.Generator().manual_seed(1)
    for E, M, k, block in [(8, 300, 2, 16), (6, 97, 3, 32), (16, 40, 4, 4)]:
        probs = torch.rand(E, generator=g) ** 4 + 1e-3
        ids = torch.multinomial(probs.expand(M, E), k, generator=g)
        check_align(ids, E, block, None, *dev(moe_align, ids, E, block, backend="triton"))


def canon(w, ids):
    """Order each row's experts by id, so kernels that sort differently compare equal."""
    order = ids.argsort(dim=-1)
    return w.gather(1, order), ids.gather(1, order)


ROUTING = [
    dict(),  # Qwen without norm_topk_prob
    dict(renormalize=True),  # Mixtral, Qwen with norm_topk_prob
    dict(scoring="sigmoid", renormalize=True, num_groups=2, topk_groups=1,
         routed_scaling_factor=2.5, bias=True),  # DeepSeek-V3
    dict(scoring="sigmoid", num_groups=1, topk_groups=1, bias=True),
]


@pytest.mark.parametrize("E", [4, 8, 6])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("M", [0, 1, 5, 64])
@pytest.mark.parametrize("kw", ROUTING, ids=["softmax", "renorm", "dsv3", "sigmoid"])
def test_select_experts_triton_matches_ref(E, k, M, kw):
    kw = dict(kw)
    g = torch.Generator().manual_seed(M + E * 5 + k)
    logits = torch.randn(M, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3 if kw.pop("bias", False) else None
    if kw.get("num_groups", 1) > 1 and k > E // kw["num_groups"]:
        kw["topk_groups"] = kw["num_groups"]  # one group cannot hold k experts here
    w, ids = dev(select_experts, logits, k, correction_bias=bias, backend="triton", **kw)
    w_ref, ids_ref = select_experts_ref(logits, k, correction_bias=bias, **kw)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (M, k)
    w, ids = canon(w, ids)
    w_ref, ids_ref = canon(w_ref, ids_ref)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("groups,topk_groups", [(4, 2), (8, 3), (16, 16)])
def test_select_experts_triton_group_limited(groups, topk_groups):
    """DeepSeek-V3 group-limited top-k at E=16, including one expert per group."""
    g = torch.Generator().manual_seed(groups)
    logits = torch.randn(37, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.5
    kw = dict(scoring="sigmoid", renormalize=True, correction_bias=bias, num_groups=groups,
              topk_groups=topk_groups, routed_scaling_factor=2.5)
    w, ids = canon(*dev(select_experts, logits, 4, backend="triton", **kw))
    w_ref, ids_ref = canon(*select_experts_ref(logits, 4, **kw))
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


def test_fused_moe_triton_config_override_grouped_order():
    """A non-default tile config (BLOCK_M 16, GROUP_M 4): the tuned-config path gives the same
    numbers, with several row blocks per expert swept in grouped launch order."""
    from megainfer.kernels.triton_moe import fused_moe_triton
    hidden, w1, w2, w, ids, emap = case(40, 4, 2, True)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=2)
    out = dev(fused_moe_triton, hidden, w1, w2, w, ids, emap, config=cfg)
    torch.testing.assert_close(out, fused_moe_ref(hidden, w1, w2, w, ids, emap),
                               rtol=1e-5, atol=1e-5)


def test_tile_config_table_lookup(tmp_path):
    from megainfer.kernels import tile_configs as tc
    key = tc.table_key(8, 64, 32, 100, torch.bfloat16, "NVIDIA_H200")
    assert key == "E=8,N=64,K=32,M=128,dtype=bfloat16,device=NVIDIA_H200"
    assert tc.m_bucket(0) == 1 and tc.m_bucket(10 ** 6) == tc.M_BUCKETS[-1]
    assert tc.default_config(8, 4, 2)["BLOCK_M"] == 16  # decode: 1 slot per expert
    assert tc.default_config(8, 4096, 2)["BLOCK_M"] == 128  # prefill
    assert set(tc.CONFIG_KEYS) <= set(tc.default_config(8, 4096, 2))
