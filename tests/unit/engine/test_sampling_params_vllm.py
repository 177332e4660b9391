"""vLLM's SamplingParams beyond temperature/top-k/top-p/min-p, through the engine on a fake
model: n (shared prefill, copy-on-write), logprobs, prompt_logprobs, stop strings, min_tokens,
presence / frequency / repetition penalties, validation. Against HF and under mpiexec:
tests/parity/test_sampling_params_hf.py."""
import dataclasses
import json
import math
import random

import pytest
import torch

from megainfer.config import CacheConfig, ModelConfig, SchedulerConfig
from megainfer.engine import LLMEngine, RequestError, SamplingParams, SamplingParamsError, StepInput
from megainfer.engine.request import Request
from megainfer.engine.sampler import Sampler, mix_seed
from test_engine_parts import run

# ------------------------------------------------------------------ fake-model engine

V = 300
CFG = ModelConfig(family="mixtral", vocab_size=V, hidden_size=8, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=4, num_experts=2, top_k=1, moe_intermediate_size=8,
                  max_position_embeddings=256, eos_token_id=(2,))


class FakeExecutor:
    """Logits for every row the step asks (``logit_token_list``): a fixed random table indexed
    by (input token, position), so the 'model' is causal and deterministic; or, with
    ``script``, the token script[position + 1 - script_from] gets logit 10 (greedy follows it)."""

    supports_full_logits = True

    def __init__(self, script=None, script_from=0):
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(V, V, generator=g) * 2
        self.script, self.script_from = script, script_from
        self.steps = []

    def execute(self, step: StepInput) -> torch.Tensor:
        self.steps.append(step)
        idx = torch.tensor(step.logit_token_list(), dtype=torch.long)
        ids, pos = step.input_ids[idx], step.positions[idx]
        logits = self.table[(ids + 7 * pos) % V].clone()
        if self.script is not None:
            for r, p in enumerate(pos.tolist()):
                k = p + 1 - self.script_from
                if 0 <= k < len(self.script):
                    logits[r, self.script[k]] = 10.0 + logits[r].abs().max()
        return logits


def make_engine(fake=None, max_num_seqs=8, budget=16, max_model_len=128, num_blocks=64,
                block_size=4):
    fake = fake or FakeExecutor()
    eng = LLMEngine(CFG, SchedulerConfig(max_num_seqs, budget, max_model_len, True),
                    CacheConfig(block_size, num_blocks), lambda kv: fake)
    return eng, fake


# ------------------------------------------------------------------ validation

@pytest.mark.parametrize("kw,field", [
    (dict(n=0), "n"), (dict(n=1.5), "n"), (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(stop=[1]), "stop"), (dict(stop=""), "stop"), (dict(stop=["a", ""]), "stop"),
    (dict(bad_words=[" "]), "bad_words"), (dict(bad_words="ab"), "bad_words"),
])
def test_validation_names_the_field(kw, field):
    with pytest.raises(SamplingParamsError, match=rf"^{field}="):
        SamplingParams(**kw)
    assert issubclass(SamplingParamsError, ValueError)


def test_stop_normalised_and_defaults():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    p = SamplingParams()
    assert (p.n, p.logprobs, p.prompt_logprobs, p.min_tokens, p.repetition_penalty) == \
        (1, None, None, 0, 1.0)
    assert dataclasses.replace(p, stop=["x"]).stop == ("x",)  # launch/inputs.py overrides


def test_prompt_logprobs_refused_without_full_logits():
    class NoFull(FakeExecutor):
        supports_full_logits = False
        deploy_mode = "disaggregated"
    eng, _ = make_engine(NoFull())
    with pytest.raises(RequestError, match=r"prompt_logprobs=2: not supported in "
                                           r"deploy.mode=disaggregated"):
        eng.add_request("a", [5, 6], SamplingParams(prompt_logprobs=2))
    assert not eng.has_unfinished()


# ------------------------------------------------------------------ penalties on hand-made logits

def _req(params, prompt, out, seed=0):
    r = Request(0, "r", None, list(prompt), params, seed=seed, eos_token_ids=(2,))
    r.output_token_ids = list(out)
    return r


def _penalised(logits, prompt, out, rep=1.0, freq=0.0, pres=0.0):
    """The reference, one token at a time."""
    x = logits.clone()
    for t in set(prompt) | set(out):
        if rep != 1:
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(out):
        x[t] -= freq * out.count(t) + pres
    return x


def test_penalties_semantics_on_handmade_logits():
    g = torch.Generator().manual_seed(1)
    Vs = 12
    logits = torch.randn(4, Vs, generator=g)
    prompt, out = [1, 5, 5, 7], [3, 3, 9, 5]
    cases = [dict(repetition_penalty=1.7), dict(frequency_penalty=0.6),
             dict(presence_penalty=-0.8), dict(repetition_penalty=0.5, frequency_penalty=1.1,
                                               presence_penalty=0.3)]
    reqs = [_req(SamplingParams(temperature=0, **c), prompt, out) for c in cases]
    # the greedy result is the argmax of the penalised logits
    got = Sampler()(logits, reqs)
    for i, c in enumerate(cases):
        ref = _penalised(logits[i], prompt, out, c.get("repetition_penalty", 1.0),
                         c.get("frequency_penalty", 0.0), c.get("presence_penalty", 0.0))
        assert got[i] == int(ref.argmax()), c
    # and the processed logits themselves (the device helper) against the reference
    from megainfer.engine.sampler import _apply_penalties
    table = torch.tensor([[i, c.get("repetition_penalty", 1.0), c.get("frequency_penalty", 0.0),
                           c.get("presence_penalty", 0.0)] for i, c in enumerate(cases)],
                         dtype=torch.float64)
    outp = torch.tensor([(j, t) for j in range(4) for t in out], dtype=torch.float64)
    prm = torch.tensor([(j, t) for j, c in enumerate(cases) if c.get("repetition_penalty", 1) != 1
                        for t in sorted(set(prompt))], dtype=torch.float64)
    proc = _apply_penalties(logits, table, outp, prm)
    for i, c in enumerate(cases):
        ref = _penalised(logits[i], prompt, out, c.get("repetition_penalty", 1.0),
                         c.get("frequency_penalty", 0.0), c.get("presence_penalty", 0.0))
        torch.testing.assert_close(proc[i], ref)


def test_penalties_only_touch_their_rows_and_min_tokens_masks_stops():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 10, generator=g)
    logits[:, 2] = 50.0  # eos would win
    logits[:, 4] = 40.0  # then the stop token
    reqs = [_req(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4]), [1], [6]),
            _req(SamplingParams(temperature=0), [1], [6]),
            _req(SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[4]), [1], [6])]
    got = Sampler()(logits, reqs)
    assert got[1] == 2 and got[2] == 2  # unconstrained; min_tokens already reached
    masked = logits[0].clone()
    masked[[2, 4]] = float("-inf")
    assert got[0] == int(masked.argmax())
    # ignore_eos: eos is still masked inside min_tokens (vLLM: its stop set always holds eos
    # for min_tokens; issue 34), and so are stop_token_ids
    r = _req(SamplingParams(temperature=0, min_tokens=3, ignore_eos=True, stop_token_ids=[4]),
             [1], [])
    assert Sampler()(logits[:1], [r]) == [int(masked.argmax())]


def test_penalties_with_random_rows_and_seeds():
    """A penalised random row samples from softmax(penalised / T): seeded, batch-invariant."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 40, generator=g)
    p = SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, seed=5)
    a = Sampler()(logits[:1], [_req(p, [1, 2], [3, 4], seed=5)])
    b = Sampler()(logits, [_req(p, [1, 2], [3, 4], seed=5),
                           _req(SamplingParams(temperature=0), [1], [])])
    assert a[0] == b[0]


# ------------------------------------------------------------------ stop strings (byte tokenizer)

def _script_engine(text: bytes, prompt=(7, 8), **kw):
    fake = FakeExecutor(script=list(text), script_from=len(prompt))
    return make_engine(fake, **kw)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(include):
    eng, _ = _script_engine(b"hello world, bye")
    eng.add_request("a", [7, 8], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop=["xyz", "o w"],
                                                include_stop_str_in_output=include))
    out = run(eng)["a"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "o w"
    assert out.text == ("hello w" if include else "hell")
    assert bytes(out.token_ids) == b"hello w"  # the ids that produced the text are kept


def test_stop_string_multibyte_and_min_tokens():
    text = "héllo wörld wörd".encode()
    eng, _ = _script_engine(text)
    eng.add_request("a", [7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                stop="ö"))
    # min_tokens: the first "ö" (bytes 8-9) falls before min_tokens=12 and is not checked
    eng.add_request("b", [7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                stop="ö", min_tokens=12))
    outs = run(eng)
    a, b = outs["a"].outputs[0], outs["b"].outputs[0]
    assert a.text == "héllo w" and bytes(a.token_ids) == "héllo wö".encode()
    assert b.text == "héllo wörld w" and bytes(b.token_ids) == "héllo wörld wö".encode()


def test_no_stop_string_hit_gives_full_text():
    eng, _ = _script_engine(b"abcdef")
    eng.add_request("a", [7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                stop="zz"))
    out = run(eng)["a"].outputs[0]
    assert out.text == "abcdef" and out.finish_reason == "length" and out.stop_reason is None


def test_bad_words_mask_the_completing_token():
    script = b"abcdef"
    eng, _ = _script_engine(script)
    eng.add_request("multi", [7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    bad_words=["cd"]))
    eng.add_request("single", [7, 8], SamplingParams(temperature=0, max_tokens=6,
                                                     ignore_eos=True, bad_words=["b"]))
    eng.add_request("none", [7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outs = run(eng)
    assert bytes(outs["none"].outputs[0].token_ids) == script
    multi, single = outs["multi"].outputs[0].token_ids, outs["single"].outputs[0].token_ids
    assert bytes(multi[:3]) == b"abc" and multi[3] != ord("d") and bytes(multi[4:]) == b"ef"
    assert single[0] == ord("a") and single[1] != ord("b") and bytes(single[2:]) == b"cdef"
    assert eng.requests == {}


# ------------------------------------------------------------------ n on the fake model

def _prompt(n, seed=0):
    g = random.Random(seed)
    return [g.randrange(3, V) for _ in range(n)]


def test_n_shares_the_prefill_and_is_seeded():
    P = _prompt(18)  # 18 % 4 != 0: the last prompt block is partial -> copy-on-write
    p = SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)
    eng, fake = make_engine()
    eng.add_request("a", P, p)
    out = run(eng)["a"]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    toks = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(toks)) == 4 and all(len(t) == 8 for t in toks)
    assert eng.num_computed_prompt_tokens == len(P)  # the prompt was computed once
    assert eng.num_block_copies >= 3
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks  # every reference dropped
    # reproducible, independent of the batch: with other requests around and a tight budget
    eng2, _ = make_engine(budget=7)
    for i in range(3):
        eng2.add_request(f"o{i}", _prompt(5 + i, seed=i),
                         SamplingParams(temperature=0.7, max_tokens=5, seed=i, n=2))
    eng2.add_request("a", P, p)
    assert [tuple(c.token_ids) for c in run(eng2)["a"].outputs] == toks
    # sample 0 is what n=1 gives with the same seed; sample i uses the seed derived from (seed, i)
    eng3, _ = make_engine()
    eng3.add_request("x", P, dataclasses.replace(p, n=1))
    eng3.add_request("y", P, dataclasses.replace(p, n=1, seed=mix_seed(11, -2)))
    o3 = run(eng3)
    assert tuple(o3["x"].outputs[0].token_ids) == toks[0]
    assert tuple(o3["y"].outputs[0].token_ids) == toks[2]


def test_n_greedy_identical_and_unseeded_distinct():
    P = _prompt(9)
    eng, _ = make_engine()
    eng.add_request("g", P, SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))
    eng.add_request("r", P, SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True))
    outs = run(eng)
    g = [c.token_ids for c in outs["g"].outputs]
    assert g[0] == g[1] == g[2]
    assert len({tuple(c.token_ids) for c in outs["r"].outputs}) == 3


def test_n_with_preemption_and_abort():
    """A pool so small that samples preempt each other: outputs equal a roomy run."""
    P = _prompt(10)
    p = SamplingParams(n=3, temperature=0.9, max_tokens=20, ignore_eos=True, seed=4)
    eng, _ = make_engine(num_blocks=64)
    eng.add_request("a", P, p)
    want = [c.token_ids for c in run(eng)["a"].outputs]
    eng2, _ = make_engine(num_blocks=12, max_model_len=40)
    eng2.add_request("a", P, p)
    got = run(eng2)
    assert eng2.num_preemptions > 0
    assert [c.token_ids for c in got["a"].outputs] == want
    assert eng2.blocks.num_free_blocks == 12
    eng3, _ = make_engine()
    eng3.add_request("a", P, p)
    eng3.step()  # the prompt is done in one step (budget 16): all three samples running
    eng3.step()
    out = eng3.abort_request("a")
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not eng3.has_unfinished() and eng3.blocks.num_free_blocks == 64


def test_n_finishing_at_fork_and_max_num_seqs():
    eng, _ = make_engine(max_num_seqs=4)
    for i in range(3):
        eng.add_request(i, _prompt(6, i), SamplingParams(n=3, temperature=1, max_tokens=1, seed=i))
    outs = run(eng)
    assert all(len(o.outputs) == 3 and all(len(c.token_ids) == 1 for c in o.outputs)
               for o in outs.values())
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


# ------------------------------------------------------------------ logprobs on the fake model

def _ref_logprobs(fake, ids, positions):
    x = fake.table[(torch.tensor(ids) + 7 * torch.tensor(positions)) % V]
    return x.log_softmax(-1)


def test_sample_logprobs_raw_and_shape():
    P = _prompt(7)
    eng, fake = make_engine()
    eng.add_request("a", P, SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True, seed=3,
                                           logprobs=3, repetition_penalty=1.5, top_k=5))
    c = run(eng)["a"].outputs[0]
    seq = P + c.token_ids
    ref = _ref_logprobs(fake, seq[len(P) - 1:-1], list(range(len(P) - 1, len(seq) - 1)))
    assert len(c.logprobs) == 5
    total = 0.0
    for i, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):
        assert next(iter(d)) == tok  # the sampled token first
        lp = ref[i]
        assert d[tok].logprob == pytest.approx(float(lp[tok]), abs=1e-5)
        assert d[tok].rank == int((lp > lp[tok]).sum()) + 1
        top = lp.topk(3).indices.tolist()
        for r, t in enumerate(top, 1):
            assert d[t].rank == r and d[t].logprob == pytest.approx(float(lp[t]), abs=1e-5)
        assert len(d) == 3 + (tok not in top)
        total += float(lp[tok])
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize("num_blocks", [64, 14])
def test_prompt_logprobs_chunked_and_preempted(num_blocks):
    Ps = [_prompt(23, 1), _prompt(30, 2), _prompt(1, 3)]
    eng, fake = make_engine(budget=7, num_blocks=num_blocks, max_model_len=48)
    for i, P in enumerate(Ps):
        eng.add_request(i, P, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                             prompt_logprobs=2 if i != 1 else 0))
    outs = run(eng)
    if num_blocks == 14:
        assert eng.num_preemptions > 0
    for i, P in enumerate(Ps):
        pl = outs[str(i)].prompt_logprobs
        assert len(pl) == len(P) and pl[0] is None
        if len(P) > 1:
            ref = _ref_logprobs(fake, P[:-1], list(range(len(P) - 1)))
        for j in range(1, len(P)):
            d, lp = pl[j], ref[j - 1]
            assert next(iter(d)) == P[j]
            assert d[P[j]].logprob == pytest.approx(float(lp[P[j]]), abs=1e-5)
            assert d[P[j]].rank == int((lp > lp[P[j]]).sum()) + 1
            k = 2 if i != 1 else 0
            assert set(lp.topk(k).indices.tolist()) <= set(d) if k else len(d) == 1
        o = outs[str(i)].outputs[0]
        assert o.logprobs is None and o.cumulative_logprob is None


# ------------------------------------------------------------------ the offline job's records

def test_output_record_logprobs_and_n():
    from launch.job import output_record
    eng, _ = make_engine()
    eng.add_request("a", _prompt(6), SamplingParams(n=2, temperature=1, max_tokens=3, seed=1,
                                                    ignore_eos=True, logprobs=2,
                                                    prompt_logprobs=1))
    eng.add_request("b", _prompt(6), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = run(eng)
    rec = json.loads(json.dumps(output_record(outs["a"])))
    c0 = outs["a"].outputs[0]
    assert rec["token_ids"] == c0.token_ids and len(rec["outputs"]) == 2
    assert rec["output_tokens"] == sum(len(c.token_ids) for c in outs["a"].outputs)
    assert rec["logprobs"][0][str(c0.token_ids[0])] == pytest.approx(
        c0.logprobs[0][c0.token_ids[0]].logprob)
    assert rec["cumulative_logprob"] == pytest.approx(c0.cumulative_logprob)
    assert rec["outputs"][1]["token_ids"] == outs["a"].outputs[1].token_ids
    assert "logprobs" in rec["outputs"][1] and rec["prompt_logprobs"][0] is None
    assert all(math.isfinite(v) for d in rec["prompt_logprobs"][1:] for v in d.values())
    plain = output_record(outs["b"])
    assert "logprobs" not in plain and "outputs" not in plain and "prompt_logprobs" not in plain
