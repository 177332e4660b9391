"""A whole request's KV through ``engine/kv_handoff.py`` (what a re-plan moves between
replicas): every layer's blocks out as one byte buffer, into other blocks of another cache, bit
for bit, GQA and MLA layouts, model dtype and fp8 storage."""
from types import SimpleNamespace

import pytest
import torch

from megainfer.engine.kv_handoff import export_kv, import_kv, kv_bytes
from megainfer.models.kv_spec import BLOCK_AXIS

SHAPES = {"gqa": (2, 6, 4, 2, 8), "mla": (6, 4, 24)}  # [2, NB, BS, H, D] / [NB, BS, R]


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_round_trip_into_other_blocks(kind, dtype):
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(SHAPES[kind], generator=g).to(dtype) for _ in range(3)]
    src = SimpleNamespace(kv_caches=caches, kv_spec=SimpleNamespace(kind=kind, block_axis=BLOCK_AXIS[kind]))
    dst = SimpleNamespace(kv_caches=[torch.zeros_like(c) for c in caches],
                          kv_spec=SimpleNamespace(kind=kind, block_axis=BLOCK_AXIS[kind]))
    buf = export_kv(src, [4, 1])
    assert buf.nbytes == kv_bytes(src, 2)
    import_kv(dst, [0, 5], buf)
    d = 0 if kind == "mla" else 1
    for a, b in zip(caches, dst.kv_caches):
        for s, t in ((4, 0), (1, 5)):
            assert torch.equal(a.select(d, s).view(torch.uint8), b.select(d, t).view(torch.uint8))
        untouched = [i for i in range(6) if i not in (0, 5)]
        assert b.index_select(d, torch.tensor(untouched)).view(torch.uint8).eq(0).all()
