"""vLLM's SamplingParams against the oracles: HF transformers where it has the feature
(repetition_penalty, min_tokens, logprobs, prompt_logprobs, n), and single mode for the
distributed runtime under mpiexec."""
import copy
import dataclasses
import json
import random

import pytest
import torch

from megainfer import LLM
from megainfer.config import ModelConfig
from megainfer.engine import LLMEngine, SamplingParams
from megainfer.engine.sampler import mix_seed
from parity_util import hf_greedy
from repo_paths import MPI_PROGS

KEY = ("mixtral", "base")


@pytest.fixture(scope="module")
def llm(tiny_ckpts):
    return LLM(tiny_ckpts[KEY], max_num_seqs=8, max_num_batched_tokens=24, block_size=4,
               max_model_len=96, num_blocks=96)


def _prompts(n, seed, lo=5, hi=30):
    g = random.Random(seed)
    return [[g.randrange(3, 256) for _ in range(g.randint(lo, hi))] for _ in range(n)]


def test_repetition_penalty_matches_hf(llm, hf_models):
    ps = _prompts(3, seed=5)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                           repetition_penalty=1.8), use_tqdm=False)
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_models(KEY), p, 16,
                                                      repetition_penalty=1.8)


def test_min_tokens_matches_hf_min_new_tokens(llm, hf_models):
    hf = hf_models(KEY)
    p = _prompts(1, seed=6)[0]
    free = hf_greedy(hf, p, 20)
    eos = free[2]
    k = free.index(eos)
    eng = llm.engine
    saved = eng.model_config
    eng.model_config = dataclasses.replace(saved, eos_token_id=(eos,))
    try:
        plain = llm.generate([p], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
        got = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, min_tokens=k + 4),
                           use_tqdm=False)
    finally:
        eng.model_config = saved
    assert plain[0].outputs[0].token_ids == free[:k + 1]
    gc_kw = dict(eos_token_id=eos, min_new_tokens=k + 4)
    want = hf_greedy(hf, p, 20, **gc_kw)
    if eos in want:
        want = want[:want.index(eos) + 1]
    c = got[0].outputs[0]
    assert c.token_ids == want and len(want) >= k + 4
    assert eos not in c.token_ids[:k + 4]


def test_min_tokens_holds_back_eos_even_with_ignore_eos(llm, hf_models):
    """vLLM: min_tokens masks eos even with ignore_eos; after it eos is a token like any other.
    HF oracle: MinNewTokensLengthLogitsProcessor over eos, with eos never stopping generation."""
    from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor
    hf = hf_models(KEY)
    p = _prompts(1, seed=6)[0]
    free = hf_greedy(hf, p, 20)
    eos = free[2]  # a token the free run emits: as eos it is the argmax at position k
    k = free.index(eos)
    eng = llm.engine
    saved = eng.model_config
    eng.model_config = dataclasses.replace(saved, eos_token_id=(eos,))
    try:
        got = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, min_tokens=k + 4,
                                               ignore_eos=True), use_tqdm=False)
    finally:
        eng.model_config = saved
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample, gc.max_new_tokens = 10**6, 0, False, 20
    ids = torch.tensor([p])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                          logits_processor=LogitsProcessorList(
                              [MinNewTokensLengthLogitsProcessor(len(p), k + 4, eos)]))
    want = out[0, len(p):].tolist()
    c = got[0].outputs[0]
    assert len(want) == 20 and c.token_ids == want and c.finish_reason == "length"
    assert eos not in c.token_ids[:k + 4] and c.token_ids[:k] == free[:k]


def test_logprobs_and_prompt_logprobs_match_hf(llm, hf_models):
    hf = hf_models(KEY)
    ps = _prompts(3, seed=7, lo=20, hi=40)  # chunked: budget 24
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                           logprobs=4, prompt_logprobs=3), use_tqdm=False)
    for p, o in zip(ps, outs):
        c = o.outputs[0]
        seq = p + c.token_ids
        with torch.no_grad():
            lp = hf(input_ids=torch.tensor([seq])).logits[0].float().log_softmax(-1)
        total = 0.0
        for i, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):
            row = lp[len(p) - 1 + i]
            assert d[tok].rank == 1 and d[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
            top = row.topk(4)
            for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
                assert d[t].rank == r and d[t].logprob == pytest.approx(v, abs=1e-4)
            total += float(row[tok])
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)
        pl = o.prompt_logprobs
        assert pl[0] is None and len(pl) == len(p)
        for j in range(1, len(p)):
            row, t = lp[j - 1], p[j]
            assert pl[j][t].logprob == pytest.approx(float(row[t]), abs=1e-4)
            assert pl[j][t].rank == int((row > row[t]).sum()) + 1
            assert set(row.topk(3).indices.tolist()) <= set(pl[j])


def test_n_on_real_model_shares_prefill_correctly(llm, hf_models):
    """Copy-on-write of the partial prompt block: greedy samples all equal HF; seeded sample i
    equals an n=1 request with the derived seed."""
    p = _prompts(1, seed=8, lo=14, hi=14)[0]  # 14 % 4 != 0
    eng = llm.engine
    before = eng.num_computed_prompt_tokens
    g = llm.generate([p], SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True),
                     use_tqdm=False)[0]
    assert eng.num_computed_prompt_tokens - before == len(p)
    want = hf_greedy(hf_models(KEY), p, 10)
    assert [c.token_ids for c in g.outputs] == [want] * 3
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True, seed=21)
    s = llm.generate([p], sp, use_tqdm=False)[0]
    ref = llm.generate([p] * 2, [dataclasses.replace(sp, n=1, seed=mix_seed(21, -i))
                                 for i in (1, 2)], use_tqdm=False)
    assert [c.token_ids for c in s.outputs[1:]] == [r.outputs[0].token_ids for r in ref]
    assert len({tuple(c.token_ids) for c in s.outputs}) == 3


@pytest.mark.parametrize("A,E", [(1, 2), (2, 0)], ids=["a1e2_m2", "colocated_a2_m2"])
def test_distributed_modes_give_single_mode_logprobs(tiny_ckpts, tmp_path, A, E):
    """Disaggregated and colocated runs under mpiexec (m=2: micro-batches cut through prompts):
    the same n seeded samples, logprobs and prompt_logprobs as single mode."""
    import os
    import sys
    sys.path.insert(0, MPI_PROGS)
    from logprobs_job import inputs, summarize
    from mpi_util import run_mpi
    from runtime_job import CACHE, SCHED

    from megainfer.config import LoadConfig
    from megainfer.models import build_model
    path = tiny_ckpts[("mixtral", "base")]
    cfg = ModelConfig.from_pretrained(path)
    single = LLMEngine.from_model(build_model(cfg, LoadConfig(path=path)), SCHED, CACHE)
    want = {o.request_id: summarize(o) for o in single.generate_stream(inputs(cfg.vocab_size))}
    out = tmp_path / "out.json"
    run_mpi(A + E, os.path.join(MPI_PROGS, "logprobs_job.py"),
            [out, A, 1, E, 2, path], timeout=600)
    got = json.loads(out.read_text())
    assert sorted(got) == sorted(want)
    for rid, w in want.items():
        g = got[rid]
        assert [s[0] for s in g["samples"]] == [s[0] for s in w["samples"]], rid
        for gs, ws in zip(g["samples"], w["samples"]):
            for gd, wd in zip(gs[1], ws[1]):
                assert [(t, r) for t, _, r in gd] == [(t, r) for t, _, r in wd], rid
                assert max(abs(a[1] - b[1]) for a, b in zip(gd, wd)) < 1e-4, rid
        assert g["prompt"][0] is None and len(g["prompt"]) == len(w["prompt"])
        for gd, wd in zip(g["prompt"][1:], w["prompt"][1:]):
            assert [t for t, _, _ in gd] == [t for t, _, _ in wd], rid
            assert max(abs(a[1] - b[1]) for a, b in zip(gd, wd)) < 1e-4, rid
