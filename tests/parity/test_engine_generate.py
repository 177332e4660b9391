"""End to end against the oracle: greedy parity with HF generate, batch invariance, chunked
prefill on/off and preemption give the same tokens, seeded sampling is per request."""
import random

import pytest

import parity_util
from conftest import FAMILIES
from megainfer import LLM, SamplingParams

N_OUT = 32


def prompts(n, seed, lo=1, hi=40, vocab=256):
    g = random.Random(seed)
    return [[g.randrange(3, vocab) for _ in range(g.randint(lo, hi))] for _ in range(n)]


def greedy(n=N_OUT):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def hf_greedy(hf, ids, n=N_OUT):
    return parity_util.hf_greedy(hf, ids, n)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(tiny_ckpts, hf_models, family):
    key = (family, "base")
    ps = prompts(8, seed=1)
    # a small token budget so prompts are chunked and decodes mix with prefill chunks
    llm = LLM(tiny_ckpts[key], max_num_seqs=8, max_num_batched_tokens=48, block_size=4,
              max_model_len=128)
    got = tokens(llm.generate(ps, greedy(), use_tqdm=False))
    want = [hf_greedy(hf_models(key), p) for p in ps]
    assert got == want


@pytest.fixture(scope="module")
def llm_odd(tiny_ckpts):
    return LLM(tiny_ckpts[("qwen2_moe", "odd")], max_num_seqs=16, max_num_batched_tokens=64,
               block_size=4, max_model_len=128)


def test_odd_shape_matches_transformers(llm_odd, hf_models):
    ps = prompts(4, seed=2)
    assert tokens(llm_odd.generate(ps, greedy(), use_tqdm=False)) == \
        [hf_greedy(hf_models(("qwen2_moe", "odd")), p) for p in ps]


def test_batch_invariance(llm_odd):
    needle = prompts(1, seed=99, lo=20, hi=20)[0]
    alone = tokens(llm_odd.generate([needle], greedy(), use_tqdm=False))[0]
    g = random.Random(0)
    for trial in range(3):
        others = prompts(g.randint(1, 12), seed=100 + trial)
        at = g.randint(0, len(others))
        batch = others[:at] + [needle] + others[at:]
        assert tokens(llm_odd.generate(batch, greedy(), use_tqdm=False))[at] == alone, trial


def test_chunked_prefill_and_preemption_do_not_change_outputs(tiny_ckpts):
    path = tiny_ckpts[("qwen3_moe", "base")]
    ps = prompts(8, seed=3, lo=10, hi=40)
    params = [greedy()] * 6 + [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=N_OUT,
                                              ignore_eos=True, seed=s) for s in (1, 2)]
    common = dict(max_num_seqs=8, block_size=4, max_model_len=96)
    whole = LLM(path, enable_chunked_prefill=False, max_num_batched_tokens=512, **common)
    chunked = LLM(path, max_num_batched_tokens=16, **common)
    tight = LLM(path, max_num_batched_tokens=32, num_blocks=30, **common)  # 120 KV tokens for 8
    ref = tokens(whole.generate(ps, params, use_tqdm=False))
    assert tokens(chunked.generate(ps, params, use_tqdm=False)) == ref
    assert tokens(tight.generate(ps, params, use_tqdm=False)) == ref
    assert tight.engine.num_preemptions > 0 and whole.engine.num_preemptions == 0
    assert tight.engine.blocks.num_free_blocks == 30


def test_seeded_sampling_is_per_request(llm_odd):
    needle = prompts(1, seed=7, lo=12, hi=12)[0]
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, max_tokens=16, seed=1234,
                        ignore_eos=True)
    alone = tokens(llm_odd.generate([needle], sp, use_tqdm=False))[0]
    others = prompts(5, seed=8)
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=16, seed=i, ignore_eos=True)
                    for i in range(5)]
    outs = llm_odd.generate(others[:2] + [needle] + others[2:],
                            mixed_params[:2] + [sp] + mixed_params[2:], use_tqdm=False)
    assert tokens(outs)[2] == alone
    other_seed = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, max_tokens=16, seed=4321,
                                ignore_eos=True)
    assert tokens(llm_odd.generate([needle], other_seed, use_tqdm=False))[0] != alone
