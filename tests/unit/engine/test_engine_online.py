"""The online engine interface: new tokens per step, requests added and aborted while the engine
runs (waiting, running, partly prefilled, forked), the engine core's messages and its idle loop."""
import threading
import time

import pytest

from megainfer import LLM, SamplingParams
from megainfer.engine_core.core import EngineCore
from megainfer.engine_core.core import EngineCoreThread
from megainfer.engine_core.messages import AbortRequest, AddRequest, CoreOutputs, Shutdown

KW = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24,
          num_blocks=40, block_size=4)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=7, seed=11, n=2, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = ["one two three four five six seven eight", "hi", "héllo ✓ wörld",
           "the quick brown fox"]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpts):
    return tiny_ckpts[("qwen3_moe", "base")]


@pytest.fixture(scope="module")
def offline(ckpt):
    llm = LLM(ckpt, **KW)
    params = [GREEDY, SEEDED, GREEDY, SEEDED]
    return {p: [c.token_ids for c in o.outputs]
            for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False))}


@pytest.fixture(scope="module")
def offline_long(ckpt):
    return _tokens(LLM(ckpt, **KW).generate(PROMPTS[0], LONG, use_tqdm=False)[0])


def _tokens(out):
    return [c.token_ids for c in out.outputs]


def test_step_outputs_report_each_new_token(ckpt, offline):
    eng = LLM(ckpt, **KW).engine
    eng.add_request("a", PROMPTS[1], SEEDED)
    eng.add_request("b", PROMPTS[0], GREEDY)
    seen, final = {}, {}
    while eng.has_unfinished():
        res = eng.step_outputs()
        keys = [(d.request_id, d.index) for d in res.new_tokens]
        assert len(keys) == len(set(keys))  # one token per running sample per step
        for d in res.new_tokens:
            assert len(d.token_ids) == 1
            seen.setdefault((d.request_id, d.index), []).extend(d.token_ids)
        for o in res.finished:
            final[o.request_id] = o
    for rid, prompt in (("a", PROMPTS[1]), ("b", PROMPTS[0])):
        assert [seen[(rid, i)] for i in range(len(final[rid].outputs))] == _tokens(final[rid])
        assert _tokens(final[rid]) == offline[prompt]


def test_requests_added_while_others_run(ckpt, offline):
    eng = LLM(ckpt, **KW).engine
    params = dict(zip(PROMPTS, [GREEDY, SEEDED, GREEDY, SEEDED]))
    eng.add_request(PROMPTS[0], PROMPTS[0], params[PROMPTS[0]])
    later, outs = list(PROMPTS[1:]), {}
    while eng.has_unfinished() or later:
        for o in eng.step():
            outs[o.request_id] = o
        if later and eng.num_steps % 2 == 0:  # one more every other step, mid-generation
            p = later.pop(0)
            eng.add_request(p, p, params[p])
    assert {p: _tokens(o) for p, o in outs.items()} == offline


def _idle(eng):
    return eng.blocks.num_free_blocks == eng.blocks.num_blocks and \
        all(c == 0 for c in eng.blocks.ref_counts) and not eng.has_unfinished()


@pytest.mark.parametrize("where", ["waiting", "partly prefilled", "running forked"])
def test_abort_anywhere_frees_blocks_and_the_others_go_on(ckpt, offline, offline_long, where):
    seats = 3 if where == "waiting" else 8  # 3: the victim's 2 samples wait for seats
    eng = LLM(ckpt, **{**KW, "max_num_seqs": seats, "max_num_batched_tokens": 8}).engine
    assert _idle(eng)
    eng.add_request("keep0", PROMPTS[0], LONG)
    eng.add_request("keep1", PROMPTS[1], SEEDED)
    victim = eng.add_request("x", "a long prompt " * 3, SamplingParams(n=2, max_tokens=20))
    outs = {}
    for _ in range(50):
        state = (victim.status.value, victim.num_computed_tokens, len(victim.output_token_ids))
        if where == "waiting" and state[0] == "waiting":
            break
        if where == "partly prefilled" and state[0] == "running" and \
                0 < state[1] < victim.num_prompt_tokens:
            break
        if where == "running forked" and state[2] >= 2:
            break
        for o in eng.step():
            outs[o.request_id] = o
    else:
        pytest.fail(f"never reached {where}")
    assert "keep0" in eng.requests  # the others are mid-generation too
    if where == "running forked":  # its samples share the prompt's blocks
        assert eng.blocks.ref_counts[victim.block_table[0]] == 2
    out = eng.abort_request("x")
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert _tokens(outs["keep0"]) == offline_long
    assert _tokens(outs["keep1"]) == offline[PROMPTS[1]]
    assert _idle(eng) and "x" not in outs
    assert eng.abort_request("x") is None  # gone: a second abort is a no-op


def test_engine_core_messages(ckpt, offline):
    core = EngineCore(LLM(ckpt, **KW).engine)
    eng = core.engine
    tok = eng.tokenize(PROMPTS[2], GREEDY)
    assert core.handle(AddRequest("r", tok, GREEDY)) == []
    dup = core.handle(AddRequest("r", tok, GREEDY))  # refused, naming the culprit
    assert dup[0].output.outputs[0].finish_reason == "error" and "'r'" in dup[0].output.error
    core.handle(AddRequest("gone", eng.tokenize(PROMPTS[3], SEEDED), SEEDED))
    tokens, final = [], None
    for _ in range(3):
        for u in core.step():
            if u.request_id == "r":
                tokens += u.new_tokens[0].token_ids
    aborted = core.handle(AbortRequest("gone"))[0].output
    assert aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].text == ""
    while core.has_work():
        for u in core.step():
            tokens += [t for d in u.new_tokens for t in d.token_ids]
            final = u.output or final
    assert tokens == final.outputs[0].token_ids == offline[PROMPTS[2]][0]
    assert final.outputs[0].text == ""  # the frontend decodes (LLMEngine.detokenize False)
    assert core.handle(Shutdown()) == [] and _idle(eng)


def test_engine_core_thread_busy_s_counts_inside_a_round_only(ckpt):
    """``busy_s``: 0 while the loop waits for input; inside a step it grows (what rank 0 of a
    spawned job checks to declare its core hung)."""
    llm = LLM(ckpt, **KW)
    inside, release = threading.Event(), threading.Event()
    step = llm.engine.step_outputs

    def held_step():
        inside.set()
        release.wait(30)
        return step()
    llm.engine.step_outputs = held_step
    core = EngineCoreThread(EngineCore(llm.engine), lambda outs: None)
    try:
        time.sleep(0.2)
        assert core.busy_s() == 0.0
        core.submit(AddRequest("r", llm.engine.tokenize(PROMPTS[0], GREEDY), GREEDY))
        assert inside.wait(30)
        time.sleep(0.3)
        assert 0.3 <= core.busy_s() < 30
    finally:
        release.set()
        core.shutdown(30)


def test_engine_core_thread_sleeps_when_idle_and_shuts_down(ckpt, offline):
    got, done = [], threading.Event()

    def deliver(outs: CoreOutputs):
        got.append(outs)
        if any(u.output is not None and u.request_id == "r" for u in outs.updates):
            done.set()

    llm = LLM(ckpt, **KW)
    core = EngineCoreThread(EngineCore(llm.engine), deliver)
    t0 = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - t0 < 0.05  # idle: blocked on its queue, no empty iterations
    core.submit(AddRequest("r", llm.engine.tokenize(PROMPTS[0], GREEDY), GREEDY))
    assert done.wait(60)
    steps = llm.engine.num_steps
    t0 = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - t0 < 0.05 and llm.engine.num_steps == steps
    toks = [t for o in got for u in o.updates for d in u.new_tokens for t in d.token_ids]
    assert toks == offline[PROMPTS[0]][0]
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    core.submit(AddRequest("w", llm.engine.tokenize(PROMPTS[1], long), long))
    core.shutdown(30)  # aborts what runs, its output delivered, the thread ends
    assert not core.alive and core.error is None
    last = [u.output for o in got for u in o.updates if u.output is not None][-1]
    assert last.request_id == "w" and last.outputs[0].finish_reason == "abort"
    assert _idle(llm.engine)
