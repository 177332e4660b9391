"""Decode attention over the paged cache (issue 38): a batch of mixed lengths is cut into
length groups, each gathered only up to its own longest context, and still equals attention
over each sequence's own context; the plan is made once per step."""
import random

import pytest
import torch
import torch.nn.functional as F

from megainfer.models import decode_attention as da
from megainfer.models.attention import AttentionMetadata, paged_attention
from megainfer.models.kv_spec import KVCacheSpec

Hq, Hkv, D, BS = 8, 4, 64, 16  # 2 KiB fp32 K+V rows, as the bench model's


def test_split_by_length():
    row = 2 * Hkv * D * 4
    assert da.split_by_length([100] * 32, BS, row) == [(0, 32)]  # one length: one group
    assert da.split_by_length([90, 95, 100, 101], BS, row) == [(0, 4)]  # savings too small
    lens = [20] * 8 + [600] * 8
    assert da.split_by_length(lens, BS, row) == [(0, 8), (8, 16)]
    many = sorted([16 * i for i in range(1, 65)] * 4)
    groups = da.split_by_length(many, BS, row)
    assert len(groups) == da.MAX_GROUPS
    assert groups[0][0] == 0 and groups[-1][1] == len(many)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))


def _reference(q, keys, vals, lens, scale):
    """Each decode row against its own context only: [S, Hq, D]."""
    out = []
    for s, L in enumerate(lens):
        o = F.scaled_dot_product_attention(q[s][:, None, :], keys[s][:L].transpose(0, 1),
                                           vals[s][:L].transpose(0, 1), scale=scale,
                                           enable_gqa=True)  # [Hq, 1, D]
        out.append(o[:, 0])
    return torch.stack(out)


def _step(lens, fmt="auto", seed=0):
    """One decode step of len(lens) sequences whose contexts are ``lens`` tokens (the new one
    included), blocks scattered over the cache -> (ours, reference, meta)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-L // BS) for L in lens]
    perm = torch.randperm(sum(nbs), generator=g).add(1).tolist()
    tables, at = [], 0
    for n in nbs:
        tables.append(perm[at:at + n])
        at += n
    cache = KVCacheSpec("gqa", (2, Hkv, D), torch.float32, 1, fmt).allocate(sum(nbs) + 1, BS)[0]
    keys = [torch.randn(L, Hkv, D, generator=g) for L in lens]
    vals = [torch.randn(L, Hkv, D, generator=g) for L in lens]
    prefill = AttentionMetadata.build([L - 1 for L in lens], [0] * len(lens), tables, BS)
    paged_attention(torch.randn(sum(lens) - len(lens), Hq, D, generator=g),
                    torch.cat([k[:-1] for k in keys]), torch.cat([v[:-1] for v in vals]),
                    cache, prefill, D ** -0.5)
    meta = AttentionMetadata.build([1] * len(lens), [L - 1 for L in lens], tables, BS)
    q = torch.randn(len(lens), Hq, D, generator=g)
    got = paged_attention(q, torch.stack([k[-1] for k in keys]),
                          torch.stack([v[-1] for v in vals]), cache, meta, D ** -0.5)
    return got, _reference(q, keys, vals, lens, D ** -0.5), meta


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_lengths_run_in_groups_and_match_each_context(seed):
    rnd = random.Random(seed)
    lens = [rnd.choice([rnd.randint(5, 40), rnd.randint(300, 420)]) for _ in range(24)]
    got, want, meta = _step(lens, seed=seed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plan = meta.step_cache[("decode", torch.float32)]
    assert len(plan.groups) >= 2 and plan.order is not None
    # no group reads past its own longest context; the short rows never read the long ones'
    assert min(gr.length for gr in plan.groups) <= 48
    assert sum((gr.stop - gr.start) * gr.blocks.shape[1] for gr in plan.groups) < \
        len(lens) * -(-max(lens) // BS) * 0.75


def test_one_length_is_one_unmasked_group():
    got, want, meta = _step([101] * 6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plan = meta.step_cache[("decode", torch.float32)]
    assert len(plan.groups) == 1 and plan.groups[0].mask is None and plan.order is None


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp4_e2m1"])
def test_groups_read_a_low_bit_cache_as_one_batch_does(fmt, monkeypatch):
    lens = [9, 12, 30, 350, 380, 400, 17, 333]
    grouped, _, meta = _step(lens, fmt)
    assert len(meta.step_cache[("decode", torch.float32)].groups) >= 2
    monkeypatch.setattr(da, "MAX_GROUPS", 1)
    single, _, meta = _step(lens, fmt)
    assert len(meta.step_cache[("decode", torch.float32)].groups) == 1
    torch.testing.assert_close(grouped, single, rtol=1e-5, atol=1e-5)
