"""Automatic prefix caching (docs/engine.md, "Prefix caching"): the block manager's keys, token
check, LRU eviction and reference counts; the scheduler's hits (never the last token,
``num_cached_tokens``); and on a real tiny model, greedy tokens identical with caching on and
off under preemption and eviction, with a forced hash collision, with n > 1 and prompt logprobs."""
import pytest

from megainfer import LLM
from megainfer.engine import SamplingParams
from megainfer.engine import block_manager as bm_mod
from megainfer.engine.block_manager import BlockManager, hash_block_tokens
from megainfer.engine.request import Request
from test_engine_parts import expected_tokens, make_engine, run
from repo_paths import MPI_PROGS


def _req(tokens, rid="r"):
    return Request(0, rid, None, list(tokens), SamplingParams(), seed=0)


def _computed(bm, tokens, rid="r"):
    """A request whose ``tokens`` were all computed (and its full blocks registered)."""
    r = _req(tokens, rid)
    hits = bm.find_cached(r)
    assert bm.allocate(r, len(tokens), cached=hits)
    r.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(r)
    return r


def test_hash_is_deterministic_and_chained():
    assert hash_block_tokens(None, [1, 2, 3]) == hash_block_tokens(None, [1, 2, 3])
    k = hash_block_tokens(None, [1, 2, 3])
    assert 0 <= k < 2 ** 64 and k != hash_block_tokens(None, [1, 2, 4])
    assert hash_block_tokens(k, [5, 6]) != hash_block_tokens(None, [5, 6])


def test_hits_never_cover_the_last_token():
    bm = BlockManager(16, 4, True)
    a = _computed(bm, range(1, 13))  # 3 full blocks
    bm.free_request(a)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 16
    assert len(bm.find_cached(_req(range(1, 13)))) == 2  # whole prompt cached: last block redone
    assert len(bm.find_cached(_req(range(1, 14)))) == 3
    assert len(bm.find_cached(_req(range(1, 12)))) == 2
    assert bm.find_cached(_req(range(1, 5))) == []
    assert bm.find_cached(_req([9] + list(range(2, 13)))) == []  # first block differs
    assert len(bm.find_cached(_req(range(1, 14)), max_tokens=7)) == 1
    assert BlockManager(16, 4, False).find_cached(_req(range(1, 14))) == []


def test_lru_eviction_order():
    bm = BlockManager(6, 2, True)
    r1 = _computed(bm, [1, 2, 3, 4, 5], "r1")  # blocks 0, 1 full and cached, 2 partial
    assert r1.block_table == [0, 1, 2]
    bm.free_request(r1)
    assert list(bm.free) == [3, 4, 5, 2] and list(bm.evictable) == [1, 0]  # last block first
    r2 = _computed(bm, [7, 8, 9, 10], "r2")  # blocks 3, 4
    bm.free_request(r2)
    assert list(bm.evictable) == [1, 0, 4, 3]
    # a hit takes a block out of the LRU list; freed again it is the most recent
    r3 = _req([1, 2, 3], "r3")
    assert bm.find_cached(r3) == [0]
    assert bm.allocate(r3, 3, cached=[0]) and r3.block_table == [0, 5]
    assert r3.num_computed_tokens == 2
    bm.free_request(r3)
    assert list(bm.evictable) == [1, 4, 3, 0] and list(bm.free) == [2, 5]
    # never-used / uncached blocks go first, then the least recently used cached ones
    big = _req(range(20, 28), "big")
    assert bm.allocate(big, 8) and big.block_table == [2, 5, 1, 4]
    assert bm.num_evictions == 2 and list(bm.evictable) == [3, 0]
    assert bm.find_cached(_req([1, 2, 3, 4, 5])) == [0]  # block 1 evicted: chain ends
    assert bm.find_cached(_req([7, 8, 9])) == [3]


def test_reference_counts_keep_shared_cached_blocks():
    bm = BlockManager(8, 2, True)
    a = _computed(bm, [1, 2, 3, 4, 5], "a")
    b = _req([1, 2, 3, 4, 9], "b")
    hits = bm.find_cached(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, 5, cached=hits)
    assert [bm.ref_counts[x] for x in hits] == [2, 2]
    bm.free_request(a)
    assert [bm.ref_counts[x] for x in hits] == [1, 1] and not bm.evictable
    # in use: never evicted, even when the pool runs dry
    hog = _req(range(10, 30), "hog")
    assert not bm.allocate(hog, 16)  # 8 blocks, 3 held by b
    assert bm.allocate(hog, 10) and not set(hog.block_table) & set(b.block_table)
    bm.free_request(b)
    assert list(bm.evictable) == hits[::-1] and bm.num_free_blocks == 3
    bm.free_request(hog)
    assert all(c == 0 for c in bm.ref_counts) and bm.num_free_blocks == 8


def test_collision_is_caught_by_the_token_and_parent_check(monkeypatch):
    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda parent, tokens: 7)
    bm = BlockManager(8, 2, True)
    a = _computed(bm, [1, 2, 3, 4, 5], "a")
    assert bm.num_cached_blocks == 1  # block 1's key collides with block 0's: not registered
    assert bm.find_cached(_req([9, 9, 3, 4, 5])) == []  # same key, other tokens
    assert bm.find_cached(_req([1, 2, 9, 9, 5])) == [a.block_table[0]]
    # a hash that ignores the parent: block tokens match but the prefix differs
    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda parent, tokens: hash(tuple(tokens)))
    bm = BlockManager(8, 2, True)
    a = _computed(bm, [1, 2, 5, 6, 7], "a")
    assert bm.num_cached_blocks == 2
    assert bm.find_cached(_req([5, 6, 5, 6, 7])) == []  # [5, 6] is cached, as a second block
    assert bm.find_cached(_req([1, 2, 5, 6, 0])) == a.block_table[:2]


# ------------------------------------------------------------------ engine, fake model

def test_num_cached_tokens_and_generated_blocks():
    eng, fake = make_engine(block_size=4, budget=32)
    eng.blocks.enable_prefix_caching = True
    g = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    A = list(range(3, 13))  # 10 tokens; + 6 generated: 15 computed, 3 full blocks
    eng.add_request("a", A, g)
    outs = run(eng)
    assert outs["a"].num_cached_tokens == 0 and eng.num_computed_prompt_tokens == 10
    a_out = outs["a"].outputs[0].token_ids
    eng.add_request("b", A[:8] + [40, 41], g)    # 2 shared blocks
    eng.add_request("c", A[:8], g)               # the whole prompt cached: 4 reused, not 8
    eng.add_request("d", A + a_out[:3], g)       # a generated token's block hits too
    eng.add_request("e", [4] + A[1:], g)         # first token differs: nothing
    before, nsteps = eng.num_computed_prompt_tokens, len(fake.steps)
    outs = run(eng)
    got = {k: o.num_cached_tokens for k, o in outs.items()}
    assert got == {"b": 8, "c": 4, "d": 12, "e": 0}
    assert eng.num_computed_prompt_tokens - before == 2 + 4 + 1 + 10
    first = fake.steps[nsteps]
    assert first.context_lens == [8, 4, 12, 0] and first.query_lens == [2, 4, 1, 10]
    for k, p in (("b", A[:8] + [40, 41]), ("c", A[:8]), ("d", A + a_out[:3])):
        assert outs[k].outputs[0].token_ids == expected_tokens(p, 6)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_preempted_request_hits_its_own_blocks():
    eng, fake = make_engine(budget=32, max_model_len=48, num_blocks=12)
    assert eng.blocks.enable_prefix_caching  # the default
    prompts = [list(range(3, 3 + n)) for n in (25, 3, 9, 14)]
    for i, p in enumerate(prompts):
        eng.add_request(i, p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    outs = run(eng)
    assert eng.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == expected_tokens(p, 10)
    # a re-admitted request started from cached blocks (context > 0 on its first step back)
    restarts = [c for s in fake.steps for c, q in zip(s.context_lens, s.query_lens) if c and q > 1]
    assert restarts
    assert eng.blocks.num_free_blocks == 12 and all(c == 0 for c in eng.blocks.ref_counts)


@pytest.mark.parametrize("caching", [False, True])
def test_n_seeded_samples_same_with_caching(caching):
    outs = []
    for on in (False, caching):
        eng, _ = make_engine(num_blocks=14, max_model_len=40)
        eng.blocks.enable_prefix_caching = on
        P = list(range(5, 23))  # 18 tokens: a partial last block, copied on write
        eng.add_request("x", P[:12] + [1], SamplingParams(temperature=0, max_tokens=3))
        eng.add_request("a", P, SamplingParams(n=3, temperature=0.9, max_tokens=16,
                                               ignore_eos=True, seed=4))
        o = run(eng)
        outs.append([c.token_ids for c in o["a"].outputs])
        assert eng.blocks.num_free_blocks == 14 and all(c == 0 for c in eng.blocks.ref_counts)
    assert outs[0] == outs[1]


# ------------------------------------------------------------------ real tiny model

def _shared_prefix_prompts(seed=5):
    import random
    g = random.Random(seed)
    systems = [[g.randrange(3, 200) for _ in range(n)] for n in (13, 20, 9)]
    return [systems[i % 3] + [g.randrange(3, 200) for _ in range(1 + i % 5)] for i in range(10)]


def _llm(ckpt, on, **kw):
    args = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                num_blocks=20, enable_prefix_caching=on)
    args.update(kw)
    return LLM(ckpt, **args)


def test_greedy_tokens_identical_on_off_with_preemption_and_eviction(tiny_ckpts, monkeypatch):
    ckpt = tiny_ckpts[("mixtral", "base")]
    prompts = _shared_prefix_prompts()
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    res = {}
    for on in (False, True):
        llm = _llm(ckpt, on)
        outs = llm.generate(prompts, p, use_tqdm=False)
        eng = llm.engine
        res[on] = ([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs],
                   eng.num_computed_prompt_tokens, eng.num_preemptions, eng.blocks.num_evictions)
    off, on = res[False], res[True]
    assert on[0] == off[0]
    assert off[3] > 0 and on[3] > 0, "the pool must force preemption"
    assert on[4] > 0, "and eviction"
    assert sum(off[1]) == 0 and sum(on[1]) > 0
    assert on[2] < off[2]
    # a forced hash collision (every key equal): the token check refuses wrong reuse
    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda parent, tokens: 7)
    llm = _llm(ckpt, True)
    outs = llm.generate(prompts, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == off[0]


def test_n_and_prompt_logprobs_on_real_model(tiny_ckpts):
    ckpt = tiny_ckpts[("mixtral", "base")]
    prompts = _shared_prefix_prompts(seed=9)[:4]
    pn = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    pl = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    res = {}
    for on in (False, True):
        llm = _llm(ckpt, on, num_blocks=64)
        first = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2),
                             use_tqdm=False)
        outs = llm.generate(prompts[3:4] + prompts[1:2], pn, use_tqdm=False)
        lp = llm.generate(prompts[3:4], pl, use_tqdm=False)[0]
        res[on] = (first[0].outputs[0].token_ids, [[c.token_ids for c in o.outputs] for o in outs],
                   [o.num_cached_tokens for o in outs], lp)
    assert res[True][0] == res[False][0] and res[True][1] == res[False][1]
    assert res[True][2][0] > 0  # prompts 0 and 3 share a system prompt
    a, b = res[False][3], res[True][3]
    assert b.num_cached_tokens == 0  # prompt_logprobs need every position: no hit
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(b.prompt_logprobs) == len(prompts[3])
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert x.keys() == y.keys()
        for t in x:
            assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5)


# ------------------------------------------------------------------ disaggregated, mpiexec

@pytest.mark.parametrize("TP", [1, 2], ids=["a1e1", "a1tp2e1"])
def test_disaggregated_with_caching_gives_single_mode_tokens(tiny_ckpts, tmp_path, TP):
    """1 attention replica (TP 1 or 2: identical schedulers, the same keys) + 1 expert rank,
    prefix caching on, shared prefixes on a pool that preempts and evicts: the tokens of
    single mode with caching off."""
    import json
    import os
    import sys

    from mpi_util import run_mpi
    sys.path.insert(0, MPI_PROGS)
    from runtime_job import shared_reference

    ckpt = tiny_ckpts[("qwen3_moe", "base")]
    want, preemptions = shared_reference(ckpt, 12)
    assert preemptions > 0
    out = tmp_path / "out.json"
    run_mpi(TP + 1, os.path.join(MPI_PROGS, "runtime_job.py"),
            [out, 1, TP, 1, "1,2", ckpt, 12, "shared"], timeout=600)
    got = json.loads(out.read_text())
    for m in (1, 2):
        assert got[f"{ckpt}|m={m}"] == want, m
        assert got[f"{ckpt}|m={m}|cached"] > 0, m


def test_job_summary_reports_the_prefix_hit_rate(tiny_ckpts, tmp_path):
    import json

    from megainfer.launch.job import run_offline_job
    from megainfer.engine import PromptInput
    ckpt = tiny_ckpts[("mixtral", "base")]
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    sys_prompt = list(range(10, 30))  # 20 tokens: 5 blocks of 4
    reqs = [PromptInput(i, prompt_token_ids=sys_prompt + [40 + i], params=p) for i in range(3)]
    llm = _llm(ckpt, True, max_num_seqs=1)  # one at a time: the 2nd and 3rd hit 20 tokens
    s = run_offline_job(reqs, llm, str(tmp_path / "out.jsonl"), progress=False)
    assert (s.prompt_tokens, s.cached_prompt_tokens) == (63, 40)
    assert s.prefix_hit_rate == pytest.approx(40 / 63)
    assert "prefix cache hit rate" in s.table() and "63.5%" in s.table()
    recs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["num_cached_tokens"] for r in recs] == [0, 20, 20]
    assert llm.engine.num_computed_prompt_tokens == 63 - 40


def test_config_default_on_and_hydra_key():
    from hydra import compose, initialize_config_module

    from megainfer.config import CacheConfig
    from megainfer.engine.job_doors import settings_from_config
    assert CacheConfig().enable_prefix_caching
    for over, want in (([], True), (["cache.enable_prefix_caching=false"], False)):
        with initialize_config_module(config_module="megainfer.conf", version_base=None):
            cfg = compose("config", overrides=over)
        assert settings_from_config(cfg, 1).cache.enable_prefix_caching is want


def test_bench_script_smoke(tmp_path):
    """perf/bench/bench_prefix_cache.py on a tiny workload: both sides agree, caching saves prefill."""
    import json

    from perf_util import run_perf
    out = tmp_path / "r.json"
    run_perf("bench/bench_prefix_cache.py", [
        "--systems", "2", "--per-system", "3", "--system-len", "32", "--suffix-len", "4",
        "--output-len", "2", "--max-num-batched-tokens", "40", "--threads", "1", "--out", out,
        "--small-blocks", "6", "--host-kv-gib", "0.01", "--routing-systems", "3",
        "--routing-per-system", "2", "--routing-system-len", "32", "--routing-output-len", "2",
        "--routing-blocks", "12"])
    r = json.loads(out.read_text())
    assert r["greedy_token_agreement"] and r["prefill_work_ratio"] > 1.2
    assert r["results"]["caching on"]["hit_rate"] > 0.2
    assert r["results"]["on, small pool + tier"]["hit_rate"] > 0.2
    assert r["routing"]["greedy_token_agreement"]
    assert sum(r["routing"]["cache_aware"]["assigned"]) == 6
