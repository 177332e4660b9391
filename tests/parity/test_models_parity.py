"""Model parity with Hugging Face transformers (the oracle), per family and shape."""
import pytest
import torch

from conftest import FAMILIES, SHAPES
from megainfer.config import LoadConfig, ModelConfig
from megainfer.models import AttentionMetadata, allocate_kv_cache, build_model

CASES = [(f, s) for f in FAMILIES for s in SHAPES]


def _ours(path):
    return build_model(ModelConfig.from_pretrained(path), LoadConfig(path=path))


@pytest.mark.parametrize("family,shape", CASES)
@pytest.mark.parametrize("length", [1, 7, 64])
def test_logits_match_transformers(tiny_ckpts, hf_models, family, shape, length):
    model = _ours(tiny_ckpts[(family, shape)])
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        ref = hf_models((family, shape))(ids[None]).logits[0]  # [T, V]
        got = model.compute_logits(model(ids, torch.arange(length)))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def _cached_forward(model, ids, chunks, block_size=4):
    """Feed ids through the paged cache in the given chunk sizes; return per-token logits."""
    cfg = model.config
    caches = allocate_kv_cache(cfg.num_layers, 64, block_size, cfg.num_kv_heads, cfg.head_dim)
    blocks = list(range(7, 7 + (len(ids) + block_size - 1) // block_size))  # non-trivial ids
    out, done = [], 0
    for n in chunks:
        meta = AttentionMetadata.build([n], [done], [blocks], block_size)
        h = model(ids[done:done + n], torch.arange(done, done + n), meta, caches)
        out.append(model.compute_logits(h))
        done += n
    return torch.cat(out)


@pytest.mark.parametrize("family,shape", CASES)
def test_cached_incremental_equals_full_forward(tiny_ckpts, family, shape):
    model = _ours(tiny_ckpts[(family, shape)])
    ids = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model.compute_logits(model(ids, torch.arange(23)))
        for chunks in ([23], [10, 1, 1, 5, 6], [1] * 23):
            torch.testing.assert_close(_cached_forward(model, ids, chunks), full, atol=1e-5, rtol=1e-5)


def test_batched_paged_decode_matches_single(tiny_ckpts):
    """Several sequences of different lengths in one step (decodes padded, a prefill chunk)."""
    model = _ours(tiny_ckpts[("qwen2_moe", "base")])
    cfg, bs = model.config, 4
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (9, 3, 14)]
    with torch.no_grad():
        want = [model.compute_logits(model(s, torch.arange(len(s))))[-1] for s in seqs]
        caches = allocate_kv_cache(cfg.num_layers, 32, bs, cfg.num_kv_heads, cfg.head_dim)
        tables = [[0, 1, 2], [5], [9, 3, 4, 8]]
        # step 1: prefill all but the last token of seqs 0 and 1, whole of seq 2
        meta = AttentionMetadata.build([8, 2, 14], [0, 0, 0], tables, bs)
        ids = torch.cat([seqs[0][:8], seqs[1][:2], seqs[2]])
        pos = torch.cat([torch.arange(8), torch.arange(2), torch.arange(14)])
        h = model(ids, pos, meta, caches)
        got2 = model.compute_logits(h[-1:])[0]
        # step 2: one decode token each for seqs 0 and 1
        meta = AttentionMetadata.build([1, 1], [8, 2], tables[:2], bs)
        h = model(torch.stack([seqs[0][8], seqs[1][2]]), torch.tensor([8, 2]), meta, caches)
        got = model.compute_logits(h)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got2, want[2], atol=1e-5, rtol=1e-5)


def test_greedy_margins_above_noise(tiny_ckpts):
    """The tiny checkpoints must give argmax margins far above fp32 noise (cross-mode tests)."""
    model = _ours(tiny_ckpts[("mixtral", "base")])
    ids = torch.randint(0, model.config.vocab_size, (32,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top2 = model.compute_logits(model(ids, torch.arange(32))).topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 1e-3
