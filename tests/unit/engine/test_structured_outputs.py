"""Structured outputs in the engine: StructuredOutputsParams validated, grammars compiled once
(cached by spec) with xgrammar, the bitmask applied before logit_bias and the penalties, n > 1
samples each with their own matcher, a dead end ending the sample, the state surviving a
pickle (re-plans, PD) and, on a random tiny model, every output under a JSON schema valid."""
import json
import pickle
import re

import jsonschema_rs
import pytest
import torch

from megainfer import LLM, SamplingParams
from megainfer.engine import RequestError, SamplingParamsError
from megainfer.engine import grammar
from megainfer.engine.grammar import Grammars
from megainfer.engine.grammar_state import DEAD_END, GrammarState
from megainfer.engine.request import Request
from megainfer.engine.sampler import Sampler
from megainfer.engine.structured_outputs import StructuredOutputsParams as SO
from megainfer.engine.tokenizer import ByteTokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["ada", "bob", "cy"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    "pet": {"anyOf": [{"type": "null"}, {"enum": ["cat", "dog"]}]}},
    "required": ["name", "age", "tags", "pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_ckpts):
    return LLM(tiny_ckpts[("qwen3_moe", "base")], max_model_len=256, max_num_seqs=32)


def test_params_are_checked_naming_the_field():
    for kw, msg in [({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
                    ({"json": "{nope"}, r"structured_outputs\.json.*not JSON text"),
                    ({"json": {"type": "strin"}}, r"structured_outputs\.json.*type"),
                    ({"json": {"properties": []}}, r"json.*properties"),
                    ({"json": {"required": "a"}}, r"json.*required"),
                    ({"json": [1]}, "must be an object"), ({"regex": ""}, "regex"),
                    ({"choice": []}, "choice"), ({"choice": ["a", 3]}, "choice"),
                    ({"grammar": " "}, "grammar")]:
        with pytest.raises(SamplingParamsError, match=msg):
            SO(**kw)
    with pytest.raises(SamplingParamsError, match=r"structured_outputs\.jsn"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(SamplingParamsError, match="structured_outputs="):
        SamplingParams(structured_outputs="json")
    p = SamplingParams(structured_outputs={"json": json.dumps(SCHEMA)})
    assert p.structured_outputs == SO(json=SCHEMA)  # text or dict: the same spec
    assert pickle.loads(pickle.dumps(p)) == p  # travels to the sampling ranks
    assert SO(choice=["a", "b"]).choice == ("a", "b") and SO(json_object=True).kind == \
        "json_object"


def test_a_grammar_that_does_not_compile_is_a_request_error_naming_it(llm):
    for spec, field in [({"grammar": "root ::= x"}, "grammar"), ({"regex": "(a"}, "regex"),
                        ({"json": {"type": "object", "minProperties": "x"}}, "json")]:
        with pytest.raises(RequestError, match=rf"structured_outputs\.{field}: does not compile"):
            llm.engine.add_request("bad", "hi", SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished()


def test_compiled_once_per_spec():
    grammar.clear_cache()
    g = Grammars(ByteTokenizer((2,)), 300, (2,))
    before = dict(grammar.stats)
    a = g.get(SO(regex="[ab]+"))
    assert g.get(SO(regex="[ab]+")) is a  # the cache, by spec
    assert Grammars(ByteTokenizer((2,)), 300).get(SO(regex="[ab]+")) is a  # an intake's handle
    assert grammar.stats["compiled"] - before["compiled"] == 1
    assert g.get(SO(regex="[ab]+c")) is not a


def _req(params, out=(), seed=0):
    r = Request(0, "r", None, [1, 2, 3], params, seed=seed, eos_token_ids=(2,))
    r.output_token_ids = list(out)
    return r


def test_mask_comes_before_logit_bias_and_penalties():
    """A token the grammar forbids stays forbidden whatever logit_bias and the penalties do;
    among the allowed ones, the bias decides (it applies after the mask)."""
    g = Grammars(ByteTokenizer((2,)), 300, (2,))
    s = Sampler(g)
    logits = torch.zeros(2, 300)
    logits[:, ord("z")] = 50.0
    p = SamplingParams(temperature=0, logit_bias={ord("z"): 100, ord("b"): 30},
                       presence_penalty=2.0, structured_outputs={"regex": "[ab]x"})
    plain = SamplingParams(temperature=0, logit_bias={ord("z"): 100})
    assert s(logits, [_req(p), _req(plain)]) == [ord("b"), ord("z")]
    assert s(logits, [_req(p, [ord("b")])])[0] == ord("x")  # the matcher followed the output
    done = _req(p, [ord("a"), ord("x")])
    assert s(logits, [done]) == [2]  # complete: only eos is left


def test_state_pickles_without_its_matcher_and_resyncs():
    g = Grammars(ByteTokenizer((2,)), 300, (2,))
    st = GrammarState(SO(regex="abc"), g)
    assert st.sync([ord("a"), ord("b")], g) is None
    moved = pickle.loads(pickle.dumps(st))
    assert moved.matcher is None and moved.spec == st.spec
    assert moved.sync([ord("a"), ord("b")], g) is None and moved.seen == 2
    assert moved.sync([ord("a"), ord("b"), ord("x")], g) == DEAD_END
    assert st.sync([ord("a"), ord("b"), ord("c"), 2], g) == "stop"


def _valid(schema):
    return jsonschema_rs.validator_for(schema).is_valid


def test_every_output_of_a_random_model_follows_its_schema(llm):
    """200 random-sampled outputs of a random-weight model under a JSON schema all parse and
    validate; each finished at the grammar's end (stop), not by length."""
    valid = _valid(SCHEMA)
    outs = llm.generate([f"p{i}" for i in range(50)], SamplingParams(
        n=4, temperature=1.0, max_tokens=160, structured_outputs={"json": SCHEMA}),
        use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 200
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    for t in texts:
        assert valid(json.loads(t)), t
    assert len(set(texts)) > 20  # the n samples of a prompt each followed their own matcher


def test_regex_choice_grammar_and_json_object(llm):
    kw = dict(temperature=1.0, max_tokens=64)
    for o in llm.generate(["a", "b", "c"], SamplingParams(**kw, n=4, structured_outputs={
            "regex": r"[a-c]{2,4}-\d{2}"}), use_tqdm=False):
        assert all(re.fullmatch(r"[a-c]{2,4}-\d{2}", c.text) for c in o.outputs), o.outputs
    for o in llm.generate(["a", "b"], SamplingParams(**kw, n=4, structured_outputs={
            "choice": ["yes", "no", "maybe not"]}), use_tqdm=False):
        assert all(c.text in ("yes", "no", "maybe not") for c in o.outputs)
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for o in llm.generate(["a", "b"], SamplingParams(**kw, n=2, structured_outputs={
            "grammar": ebnf}), use_tqdm=False):
        for c in o.outputs:
            assert c.finish_reason == "length" or re.fullmatch(
                r"\(\d{1,2}(\+\d{1,2})*\)", c.text), c.text
    obj = llm.generate("a", SamplingParams(temperature=0, max_tokens=200, structured_outputs={
        "json_object": True}), use_tqdm=False)[0].outputs[0]
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)


def test_greedy_is_deterministic_and_ignore_eos_still_ends_at_the_grammar(llm):
    p = SamplingParams(temperature=0, max_tokens=100, structured_outputs={"json": SCHEMA})
    a = llm.generate(["x", "y"], p, use_tqdm=False)
    b = llm.generate(["x", "y"], p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    free = llm.generate("x", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                                            structured_outputs={"choice": ["yes", "no"]}),
                        use_tqdm=False)[0].outputs[0]
    assert free.text in ("yes", "no") and free.finish_reason == "stop"


def test_a_dead_end_ends_the_sample_with_its_own_reason(llm):
    """min_tokens masks eos where the grammar allows nothing else: the sample ends there."""
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=50, min_tokens=10,
                                           structured_outputs={"choice": ["yes"]}),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == DEAD_END and out.text.startswith("yes")


def test_the_host_kernel_and_the_device_path_mask_alike():
    """apply_bitmask: xgrammar's host kernel (fp32 on the CPU) and the torch ops other devices
    and dtypes use give the same logits."""
    from megainfer.engine.grammar_state import apply_bitmask
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 70, generator=g)
    bits = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=g, dtype=torch.int64).to(
        torch.int32)
    a, b = x.clone(), x.double()
    apply_bitmask(a, [1, 3], bits)
    apply_bitmask(b, [1, 3], bits)  # fp64: the torch path
    assert torch.equal(a, b.float()) and torch.equal(a[0], x[0]) and torch.equal(a[2], x[2])
    allowed = [t for t in range(70) if (int(bits[0, t // 32]) >> (t % 32)) & 1]
    assert torch.isfinite(a[1]).nonzero().flatten().tolist() == allowed


def test_async_llm_streams_follow_the_grammar(tiny_ckpts, llm):
    """AsyncLLM (the engine core on its own thread, the frontend's intake compiling): the
    streamed texts grow into what LLM.generate gives, and a spec that does not compile is
    refused at once."""
    import asyncio

    from megainfer import AsyncLLM
    p = SamplingParams(temperature=0, max_tokens=100, structured_outputs={"json": SCHEMA})
    want = llm.generate(["x", "y"], p, use_tqdm=False)

    async def run():
        engine = AsyncLLM(tiny_ckpts[("qwen3_moe", "base")], max_model_len=256)
        try:
            async def one(i, prompt):
                texts = []
                async for out in engine.generate(prompt, p, f"r{i}"):
                    texts.append(out.outputs[0].text)
                return texts
            got = await asyncio.gather(one(0, "x"), one(1, "y"))
            with pytest.raises(RequestError, match="structured_outputs.regex"):
                async for _ in engine.generate("z", SamplingParams(
                        structured_outputs={"regex": "(("}), "bad"):
                    pass
            return got
        finally:
            engine.shutdown()
    got = asyncio.run(run())
    for texts, o in zip(got, want):
        assert texts[-1] == o.outputs[0].text and all(o.outputs[0].text.startswith(t)
                                                       for t in texts)
        assert _valid(SCHEMA)(json.loads(texts[-1]))


def test_start_after_leaves_the_output_free_until_the_marker():
    g = Grammars(ByteTokenizer((2,)), 300, (2,))
    s = Sampler(g)
    logits = torch.zeros(1, 300)
    logits[0, ord("z")] = 5.0
    p = SamplingParams(temperature=0, structured_outputs={"regex": "[ab]x",
                                                          "start_after": "</think>"})
    before = [ord(c) for c in "hmm</think"]
    assert s(logits, [_req(p, before)]) == [ord("z")]  # the marker is not whole yet: free
    after = [ord(c) for c in "hmm</think>"]
    assert s(logits, [_req(p, after)]) in ([ord("a")], [ord("b")])
    st = GrammarState(p.structured_outputs, g)
    assert st.sync(after + [ord("a"), ord("x")], g) is None and st.start == len(after)
    moved = pickle.loads(pickle.dumps(st))  # re-scans for the marker where it lands
    assert moved.sync(after + [ord("a"), ord("x"), 2], g) == "stop" and moved.start == len(after)
    assert SO(regex="a", start_after="</think>").key == SO(regex="a").key  # one compile


def test_a_grammar_that_fails_on_the_sampling_rank_ends_only_its_request(llm):
    """Past intake (as a rank whose vocabulary differs would see it): the request ends as a
    dead end, the engine and the other requests go on."""
    from megainfer.engine.intake import TokenizedPrompt
    eng = llm.engine
    eng.add_tokenized("broken", TokenizedPrompt(None, [5, 6, 7], []), SamplingParams(
        max_tokens=5, structured_outputs={"grammar": "root ::= nope"}))
    eng.add_request("fine", "hi", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    assert done["broken"].outputs[0].finish_reason == DEAD_END
    assert done["fine"].outputs[0].finish_reason == "length"
