"""Decode attention over the paged cache (issue 38): a batch of mixed lengths is cut into
length groups, each gathered only up to its own longest context, and still equals attention
over each sequence's own context; the plan is made once per step."""
import random

import pytest
import torch
import torch.nn.functional as F

from megainfer.models import decode_attention as da
from megainfer.models import kv_gather
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


def _tables(nbs, layout, g):
    """Block ids of rows needing ``nbs`` blocks, from block 1 on: scattered (a random
    permutation), adjacent (row after row) or gapped (rows 3 blocks apart) -> (tables, blocks
    the cache needs)."""
    if layout == "scattered":
        perm = torch.randperm(sum(nbs), generator=g).add(1).tolist()
        tables, at = [], 0
        for n in nbs:
            tables.append(perm[at:at + n])
            at += n
        return tables, sum(nbs) + 1
    gap, tables, at = {"adjacent": 0, "gapped": 3}[layout], [], 1
    for n in nbs:
        tables.append(list(range(at, at + n)))
        at += n + gap
    return tables, at


def _step(lens, fmt="auto", seed=0, layout="scattered"):
    """One decode step of len(lens) sequences whose contexts are ``lens`` tokens (the new one
    included), blocks laid out as ``_tables`` says (scattered over the cache unless told)
    -> (ours, reference, meta)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-L // BS) for L in lens]
    tables, num_blocks = _tables(nbs, layout, g)
    cache = KVCacheSpec("gqa", (2, Hkv, D), torch.float32, 1, fmt).allocate(num_blocks, BS)[0]
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


@pytest.mark.parametrize("layout,lens,in_place", [
    ("adjacent", [101] * 6, True),      # one strided view of the cache, no gather
    ("gapped", [40] * 5, True),         # rows equally spaced with free blocks between
    ("adjacent", [33], True),           # one row
    ("adjacent", [100, 98, 101], True),  # one group, the same block count, masked rows
    ("scattered", [101] * 6, False),    # not affine: gathered
    ("adjacent", [20, 101, 64], False),  # rows of other block counts (padded table): gathered
])
def test_affine_block_tables_are_read_in_place(layout, lens, in_place, monkeypatch):
    """Where every row's blocks are one run and the runs are equally spaced, decode attention
    reads the cache through a strided view (no gather) and still equals attention over each
    sequence's own context."""
    gathers = []
    real = kv_gather.gather_context
    monkeypatch.setattr(kv_gather, "gather_context",
                        lambda *a, **k: gathers.append(a[1].shape) or real(*a, **k))
    monkeypatch.setattr(da, "MAX_GROUPS", 1)
    got, want, meta = _step(lens, layout=layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plan = meta.step_cache[("decode", torch.float32)]
    decode_gathers = [s for s in gathers if len(s) == 2]  # the prefill's own are 1-D
    assert (plan.groups[0].layout is not None) == in_place
    assert (not decode_gathers) == in_place


@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3"])
def test_prefill_reads_contiguous_blocks_in_place(fmt, monkeypatch):
    """A prefill chunk over one run of blocks reads them in place (a float cache) and equals
    the gathered read; a low-bit cache is still dequantised from a gather."""
    gathers = []
    real = kv_gather.gather_context
    monkeypatch.setattr(kv_gather, "gather_context",
                        lambda *a, **k: gathers.append(a[1].shape) or real(*a, **k))
    lens = [37, 45]  # 3 blocks each: the decode step is one affine group too
    got, want, _ = _step(lens, fmt, layout="adjacent")
    if fmt == "auto":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not gathers
    else:
        assert len(gathers) == 3  # prefill: 2 sequences; decode: one group of 2 rows
    g = torch.Generator().manual_seed(5)
    cache = KVCacheSpec("gqa", (2, Hkv, D), torch.float32, 1, fmt).allocate(8, BS)[0]
    k, v = torch.randn(2, 40, Hkv, D, generator=g)
    q = torch.randn(40, Hq, D, generator=g)
    in_place = paged_attention(q, k, v, cache, AttentionMetadata.build([40], [0], [[2, 3, 4]], BS),
                               D ** -0.5)
    cache.zero_()
    gathered = paged_attention(q, k, v, cache, AttentionMetadata.build([40], [0], [[5, 2, 7]], BS),
                               D ** -0.5)
    torch.testing.assert_close(in_place, gathered, rtol=1e-6, atol=1e-6)


def test_affine_layout():
    t = torch.tensor
    assert kv_gather.affine_layout(t([[3, 4, 5], [6, 7, 8]])) == (3, 3)
    assert kv_gather.affine_layout(t([[3, 4], [9, 10], [15, 16]])) == (3, 6)
    assert kv_gather.affine_layout(t([7, 8, 9])) == (7, 3)
    assert kv_gather.affine_layout(t([[3, 4], [9, 10], [16, 17]])) is None  # unequal spacing
    assert kv_gather.affine_layout(t([[3, 5], [9, 11]])) is None  # a row is not one run
    assert kv_gather.affine_layout(t([[9, 10], [3, 4]])) is None  # descending rows
