"""The prefix cache's second tier (docs/kv_cache.md, "The second tier"): raw-byte round trip for
every KV cache spec and format, the checksum catching corrupt and truncated entries, the LRU
bound, the block manager's hits past the first tier, and on a real tiny model greedy tokens
identical with the tier serving (and with its files corrupted)."""
import os
from collections import deque

import pytest
import torch

from megainfer import LLM
from megainfer.config import CacheConfig, ConfigError
from megainfer.engine import SamplingParams
from megainfer.engine.block_manager import BlockManager
from megainfer.engine.kv_tier import KVTier, TierEntry, make_kv_tier
from megainfer.engine.request import Request
from megainfer.models.kv_spec import KVCacheSpec

SPECS = {
    "gqa_fp32": KVCacheSpec("gqa", (2, 2, 16), torch.float32, 3),
    "gqa_bf16": KVCacheSpec("gqa", (2, 2, 16), torch.bfloat16, 2),
    "gqa_fp8": KVCacheSpec("gqa", (2, 2, 16), torch.float32, 2, "fp8_e4m3"),
    "gqa_fp4": KVCacheSpec("gqa", (2, 2, 32), torch.float32, 2, "fp4_e2m1"),
    "mla_fp32": KVCacheSpec("mla", (48,), torch.float32, 2, "auto", (32, 16)),
    "mla_fp4": KVCacheSpec("mla", (48,), torch.float32, 2, "fp4_e2m1", (32, 16)),
}


def _caches(spec, num_blocks=6, bs=4):
    caches = spec.allocate(num_blocks, bs)
    g = torch.Generator().manual_seed(0)
    for c in caches:  # random bytes of the storage dtype (scales untouched: per layer)
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, generator=g,
                                                dtype=torch.uint8))
    return caches


def _block(caches, dim, b):
    return [c.select(dim, b).clone() for c in caches]


def _equal(xs, ys):
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(xs, ys))


@pytest.mark.parametrize("name", list(SPECS))
def test_round_trip_every_spec_byte_exact(name, tmp_path):
    spec = SPECS[name]
    caches = _caches(spec)
    dim = spec.block_axis
    tier = KVTier(caches, dim, capacity=4, store_dir=str(tmp_path))
    want = _block(caches, dim, 2)
    tier.save(2, key=11, uid=5, parent_uid=0, tokens=(1, 2, 3, 4))
    for c in caches:  # block 2 reused by other contents; block 4 is the fresh target
        c.select(dim, 2).view(torch.uint8).fill_(0)
    assert tier.lookup(11, (1, 2, 3, 4), 1) is None  # wrong parent
    assert tier.lookup(11, (1, 2, 3, 5), 0) is None  # wrong tokens
    e = tier.lookup(11, (1, 2, 3, 4), 0)
    assert e is not None and e.uid == 5
    other = _block(caches, dim, 3)
    tier.load(e, 4)
    tier.apply_loads()
    assert _equal(_block(caches, dim, 4), want) and _equal(_block(caches, dim, 3), other)
    assert tier.num_saved == 1 and tier.num_loaded == 1 and len(tier) == 1  # kept for reuse
    assert any(f.endswith(".safetensors") for f in os.listdir(tier.store.dir))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_or_truncated_entry_is_dropped_never_served(damage, tmp_path, caplog):
    spec = SPECS["gqa_fp32"]
    caches = _caches(spec)
    tier = KVTier(caches, 1, capacity=4, store_dir=str(tmp_path), log_prefix="[attn dp0 tp0]")
    tier.save(1, key=3, uid=1, parent_uid=0, tokens=(7,) * 4)
    tier.save(2, key=4, uid=2, parent_uid=1, tokens=(8,) * 4)
    path = tier.store.path(tier.index[3].slot)
    data = open(path, "rb").read()
    if damage == "flip":
        data = data[:-5] + bytes([data[-5] ^ 0x40]) + data[-4:]
    elif damage == "truncate":
        data = data[:len(data) // 2]
    if damage == "delete":
        os.remove(path)
    else:
        open(path, "wb").write(data)
    with caplog.at_level("WARNING", logger="megainfer.engine"):
        assert tier.lookup(3, (7,) * 4, 0) is None
    assert "corrupt or truncated" in caplog.text and "[attn dp0 tp0]" in caplog.text
    assert tier.num_corrupt == 1 and 3 not in tier.index and len(tier.free_slots) == 3
    assert tier.lookup(4, (8,) * 4, 1) is not None  # the other entry is intact


def test_lru_bound_and_hits_refresh(tmp_path):
    caches = _caches(SPECS["gqa_fp32"])
    tier = KVTier(caches, 1, capacity=2, store_dir=str(tmp_path))
    tier.save(0, 10, 1, 0, (1,))
    tier.save(1, 20, 2, 0, (2,))
    assert tier.lookup(10, (1,), 0) is not None  # 10 is now the most recent
    tier.apply_loads()
    tier.save(2, 30, 3, 0, (3,))
    assert set(tier.index) == {10, 30} and tier.num_dropped == 1
    # an entry staged for this step's load is never the one given up
    assert tier.lookup(30, (3,), 0) is not None and tier.lookup(10, (1,), 0) is not None
    tier.save(3, 40, 4, 0, (4,))
    assert set(tier.index) == {10, 30}  # both busy: the new block is not kept


def _req(tokens, rid="r"):
    return Request(0, rid, None, list(tokens), SamplingParams(), seed=0)


def test_block_manager_hits_past_the_first_tier(tmp_path):
    caches = _caches(SPECS["gqa_fp32"], num_blocks=4, bs=2)
    tier = KVTier(caches, 1, capacity=8, store_dir=str(tmp_path))
    bm = BlockManager(4, 2, True, tier)
    a = _req([1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 partial: the whole pool
    assert bm.allocate(a, 7)
    a.num_computed_tokens = 7
    bm.cache_full_blocks(a)
    saved = _block(caches, 1, a.block_table[1])
    bm.free_request(a)
    b = _req([9, 9, 9, 9, 9])  # takes 3 blocks: 2 evicted cached blocks go down
    assert bm.allocate(b, 5)
    assert bm.num_evictions == 2 and len(tier) == 2
    hits = bm.find_cached(_req([1, 2, 3, 4, 5, 6, 8]))
    assert [type(h) for h in hits] == [int, TierEntry, TierEntry]  # LRU: the tail went down
    bm.free_request(b)
    c = _req([1, 2, 3, 4, 5, 6, 8])
    assert bm.allocate(c, 7, cached=hits)
    assert c.num_computed_tokens == 6 and c.block_uids == [1, 2, 3]
    tier.apply_loads()
    assert _equal(_block(caches, 1, c.block_table[1]), saved)
    # loaded blocks are first-tier cached again: the next request hits them there
    assert all(isinstance(h, int) for h in bm.find_cached(_req([1, 2, 3, 4, 5, 6, 9])))


def test_config_keys_and_errors(tmp_path):
    assert CacheConfig().host_kv_gib == 0 and CacheConfig().kv_store_dir is None
    with pytest.raises(ConfigError, match="cache.host_kv_gib"):
        CacheConfig(host_kv_gib=-1)
    with pytest.raises(ConfigError, match="cache.kv_store_dir"):
        CacheConfig(kv_store_dir="")
    spec = SPECS["gqa_fp32"]
    caches = _caches(spec)
    assert make_kv_tier(CacheConfig(4, 6), spec, caches) is None  # off by default
    with pytest.raises(ConfigError, match="cache.host_kv_gib"):
        make_kv_tier(CacheConfig(4, 6, host_kv_gib=1e-9), spec, caches)
    t = make_kv_tier(CacheConfig(4, 6, host_kv_gib=1e-4, kv_store_dir=str(tmp_path)), spec, caches)
    assert t.capacity == int(1e-4 * 2 ** 30) // t.nbytes and t.store.dir.startswith(str(tmp_path))


def test_hydra_keys():
    from hydra import compose, initialize_config_module

    from megainfer.engine.job_doors import settings_from_config
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=["cache.host_kv_gib=0.5", "cache.kv_store_dir=/tmp/x"])
    c = settings_from_config(cfg, 1).cache
    assert c.host_kv_gib == 0.5 and c.kv_store_dir == "/tmp/x"


def _prompts(seed=5):
    import random
    g = random.Random(seed)
    systems = [[g.randrange(3, 200) for _ in range(n)] for n in (13, 20, 9)]
    return [systems[i % 3] + [g.randrange(3, 200) for _ in range(1 + i % 5)] for i in range(10)]


@pytest.mark.parametrize("fmt,gran", [("auto", "token_head"), ("fp8_e4m3", "tensor"),
                                      ("fp8_e4m3", "token_head"), ("fp4_e2m1", "token_head")])
def test_greedy_tokens_identical_with_the_tier_serving(tiny_ckpts, tmp_path, fmt, gran):
    """A first tier too small to keep the prefixes (preemption and eviction forced): hits come
    back from the files; tokens equal caching off; then every stored file is corrupted and a
    rerun still gives the same tokens (entries dropped, recomputed)."""
    ckpt = tiny_ckpts[("mixtral", "base")]
    prompts = _prompts()
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    args = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                num_blocks=20, kv_cache_dtype=fmt, kv_scale_granularity=gran)
    off = LLM(ckpt, enable_prefix_caching=False, **args).generate(prompts, p, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in off]
    llm = LLM(ckpt, host_kv_gib=0.01, kv_store_dir=str(tmp_path), **args)
    outs = llm.generate(prompts, p, use_tqdm=False)
    tier, eng = llm.engine.kv_tier, llm.engine
    assert [o.outputs[0].token_ids for o in outs] == want
    assert eng.num_preemptions > 0 and eng.blocks.num_evictions > 0
    assert tier.num_saved > 0
    _push_first_tier_down(llm)  # every cached prefix now lives in the files only
    loaded = tier.num_loaded
    outs = llm.generate(prompts, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert tier.num_loaded > loaded and sum(o.num_cached_tokens for o in outs) > 0
    _push_first_tier_down(llm)
    for f in os.listdir(tier.store.dir):  # corrupt everything stored
        path = os.path.join(tier.store.dir, f)
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 0xFF
        open(path, "wb").write(bytes(data))
    outs = llm.generate(prompts, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert tier.num_corrupt > 0


def _push_first_tier_down(llm):
    """Evict every free cached first-tier block to the tier (what the LRU does under load)."""
    bm = llm.engine.blocks
    free, bm.free = bm.free, deque()  # so that _take evicts
    while bm.evictable:
        free.append(bm._take())
    bm.free = free
