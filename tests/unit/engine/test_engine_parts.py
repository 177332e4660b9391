"""Engine parts without a real model: block manager, scheduler (through a fake executor),
StepInput, sampler."""
import pytest
import torch

from megainfer.config import CacheConfig, ModelConfig, SchedulerConfig
from megainfer.engine import LLMEngine, SamplingParams, StepInput
from megainfer.engine.block_manager import BlockManager
from megainfer.engine.request import Request
from megainfer.engine.sampler import Sampler, filter_logits

V = 50
CFG = ModelConfig(family="mixtral", vocab_size=V, hidden_size=8, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=4, num_experts=2, top_k=1, moe_intermediate_size=8,
                  max_position_embeddings=128, eos_token_id=(2,))


class FakeExecutor:
    """Logits that make the next token (last input token + 1) % V, recording every step."""

    def __init__(self):
        self.steps: list[StepInput] = []

    def execute(self, step: StepInput) -> torch.Tensor:
        self.steps.append(step)
        last = step.input_ids[step.sample_token_indices()] if step.sample_rows else \
            torch.zeros(0, dtype=torch.long)
        logits = torch.zeros(len(step.sample_rows), V)
        logits[torch.arange(len(last)), (last + 1) % V] = 1.0
        return logits


def make_engine(max_num_seqs=4, budget=16, max_model_len=64, num_blocks=64, block_size=4,
                chunked=True):
    fake = FakeExecutor()
    eng = LLMEngine(CFG, SchedulerConfig(max_num_seqs, budget, max_model_len, chunked),
                    CacheConfig(block_size, num_blocks), lambda kv: fake)
    return eng, fake


def run(eng):
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return outs


def expected_tokens(prompt, n):
    return [(prompt[-1] + 1 + i) % V for i in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(3, 3 + n)) for n in (25, 3, 9, 14, 1, 30)]


@pytest.mark.parametrize("chunked", [True, False])
def test_schedule_respects_budgets_and_mixes_decode_with_prefill(chunked):
    eng, fake = make_engine(budget=64 if not chunked else 16, chunked=chunked)
    for i, p in enumerate(PROMPTS):
        eng.add_request(i, p, SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True))
    outs = run(eng)
    for i, p in enumerate(PROMPTS):  # the fake model's tokens come out, whatever the schedule
        assert outs[str(i)].outputs[0].token_ids == expected_tokens(p, 4 + i)
        assert outs[str(i)].outputs[0].finish_reason == "length"
    mixed = 0
    for s in fake.steps:
        assert s.num_tokens <= (16 if chunked else 64) and s.num_seqs <= 4
        assert s.input_ids.shape == s.positions.shape == (sum(s.query_lens),)
        has_decode = any(q == 1 and c > 0 for q, c in zip(s.query_lens, s.context_lens))
        mixed += has_decode and any(q > 1 for q in s.query_lens)
        for j, (q, c) in enumerate(zip(s.query_lens, s.context_lens)):
            lo = s.token_offsets()[j]
            assert s.positions[lo:lo + q].tolist() == list(range(c, c + q))
    assert mixed > 0
    if chunked:  # the 25- and 30-token prompts cannot fit a 16-token step whole
        assert any(q < 25 and c == 0 and s.input_ids[0] == 3 for s in fake.steps
                   for q, c in zip(s.query_lens[:1], s.context_lens[:1]))
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_sample_rows_only_for_complete_prompts():
    eng, fake = make_engine(budget=10)
    eng.add_request("a", list(range(3, 28)), GREEDY)  # 25 tokens: chunks 10, 10, 5
    eng.step()
    assert fake.steps[-1].sample_rows == [] and fake.steps[-1].query_lens == [10]
    eng.step()
    assert fake.steps[-1].sample_rows == []
    eng.step()
    assert fake.steps[-1].sample_rows == [0] and fake.steps[-1].query_lens == [5]
    eng.step()
    assert fake.steps[-1].query_lens == [1] and fake.steps[-1].context_lens == [25]


def test_preemption_recomputes_and_frees_everything():
    # 12 blocks of 4 = 48 tokens of KV for 4 requests that grow to 20-35 tokens each
    eng, fake = make_engine(budget=32, max_model_len=48, num_blocks=12)
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(i, p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    outs = run(eng)
    assert eng.num_preemptions > 0
    for i, p in enumerate(PROMPTS[:4]):
        assert outs[str(i)].outputs[0].token_ids == expected_tokens(p, 10)
    assert sum(o.metrics.num_preemptions for o in outs.values()) == eng.num_preemptions
    assert eng.blocks.num_free_blocks == 12 and all(c == 0 for c in eng.blocks.ref_counts)


def test_preempted_request_goes_to_front_of_queue():
    eng, _ = make_engine(max_num_seqs=8, budget=64, max_model_len=32, num_blocks=8)
    for i in range(3):
        eng.add_request(i, list(range(3, 13)), SamplingParams(temperature=0, max_tokens=20,
                                                               ignore_eos=True))
    eng.add_request("late", [5], GREEDY)
    while eng.num_preemptions == 0:
        eng.step()
    assert eng.scheduler.waiting[0].num_computed_tokens == 0
    assert eng.scheduler.waiting[0].request_id in ("1", "2")  # a preempted one, not "late"


def test_same_inputs_same_schedule():
    runs = []
    for _ in range(2):
        eng, fake = make_engine(budget=12, num_blocks=20, max_model_len=40)
        for i, p in enumerate(PROMPTS[:5]):
            eng.add_request(i, p, SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True))
        run(eng)
        runs.append([(s.seq_ids, s.query_lens, s.context_lens, s.block_tables,
                      s.input_ids.tolist(), s.sample_rows) for s in fake.steps])
    assert runs[0] == runs[1]


def test_empty_step_calls_executor():
    eng, fake = make_engine()
    assert eng.step() == [] and not eng.has_unfinished()
    assert len(fake.steps) == 1 and fake.steps[0].is_empty() and fake.steps[0].num_tokens == 0


def test_stop_token_and_eos():
    eng, _ = make_engine()
    eng.add_request("eos", [0], SamplingParams(temperature=0, max_tokens=10))  # 1, 2=eos
    eng.add_request("ign", [0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.add_request("stop", [0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                stop_token_ids=[3]))
    outs = run(eng)
    assert outs["eos"].outputs[0].token_ids == [1, 2] and outs["eos"].outputs[0].finish_reason == "stop"
    assert outs["ign"].outputs[0].token_ids == [1, 2, 3, 4]
    assert outs["stop"].outputs[0].token_ids == [1, 2, 3]
    assert outs["stop"].outputs[0].finish_reason == "stop"


def test_max_model_len_stops_with_length():
    eng, _ = make_engine(max_model_len=12, budget=16)
    eng.add_request("a", list(range(3, 13)), SamplingParams(temperature=0, max_tokens=50,
                                                            ignore_eos=True))
    out = run(eng)["a"].outputs[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


def test_block_manager_ref_counts():
    bm = BlockManager(4, 2)
    r = Request(0, "r", None, [1, 2, 3], SamplingParams(), seed=0)
    assert bm.allocate(r, 3) and r.block_table == [0, 1] and bm.num_free_blocks == 2
    assert not bm.allocate(r, 9) and r.block_table == [0, 1]  # all or nothing
    bm.share(1)
    bm.free_request(r)
    assert bm.ref_counts == [0, 1, 0, 0] and list(bm.free) == [2, 3, 0]
    with pytest.raises(ValueError, match="block 0"):
        bm.share(0)


def test_step_split_regroups_rows():
    s = StepInput([7, 8, 9], [3, 1, 2], [0, 5, 4], [[1], [2, 3], [4]], torch.arange(6),
                  torch.tensor([0, 1, 2, 5, 4, 5]), [1, 2])
    a, b = s.split([[0, 1], [2]])
    assert a.seq_ids == [7, 8] and a.input_ids.tolist() == [0, 1, 2, 3] and a.sample_rows == [1]
    assert b.seq_ids == [9] and b.positions.tolist() == [4, 5] and b.sample_rows == [0]
    assert s.sample_token_indices().tolist() == [3, 5]
    assert s.split([[], [0, 1, 2]])[0].is_empty()


def _brute_filter(row, k, p, mp):
    probs = row.softmax(-1)
    keep = probs >= mp * probs.max()
    order = row.argsort(descending=True)
    keep_k = torch.zeros_like(keep)
    keep_k[order[:k]] = True
    keep &= keep_k
    masked = row.masked_fill(~keep, float("-inf")).softmax(-1)
    srt, idx = masked.sort(descending=True)
    keep_p = torch.zeros_like(keep)
    acc = 0.0
    for pr, i in zip(srt.tolist(), idx.tolist()):
        if acc >= p or pr == 0:
            break
        keep_p[i] = True
        acc += pr
    return keep & keep_p


def test_filter_logits_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 20, generator=g) * 2
    ks, ps, mps = [20, 3, 20, 5, 1, 20], [1.0, 1.0, 0.5, 0.8, 1.0, 0.9], [0, 0, 0, 0.1, 0, 0.3]
    got = filter_logits(logits, torch.tensor(ks), torch.tensor(ps), torch.tensor(mps))
    for i in range(6):
        want = _brute_filter(logits[i], ks[i], ps[i], mps[i])
        assert torch.equal(torch.isfinite(got[i]), want), i
        assert torch.equal(got[i][want], logits[i][want])


def _req(params, seed=0, n_out=0):
    r = Request(0, "r", None, [1], params, seed=seed)
    r.output_token_ids = [0] * n_out
    return r


def test_sampler_distribution_and_seeds():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()[None]
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(4)
    for n in range(4000):
        counts[Sampler()(logits, [_req(params, seed=11, n_out=n)])[0]] += 1
    assert torch.allclose(counts / 4000, probs, atol=0.03)
    # same (seed, index) -> same token, whatever the other rows are
    batch = torch.cat([torch.randn(3, 4), logits])
    reqs = [_req(SamplingParams(temperature=0)), _req(params, 5), _req(params, 6),
            _req(params, 11, 17)]
    alone = Sampler()(logits, [_req(params, 11, 17)])[0]
    assert Sampler()(batch, reqs)[3] == alone
    assert Sampler()(batch, reqs)[0] == batch[0].argmax()
