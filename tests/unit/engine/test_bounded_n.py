"""``SamplingParams.n`` above ``max_num_seqs`` (issue 49): forks beyond the seats wait for one
(the scheduler's ``forked`` queue, holding their blocks) and never widen a batch; their tokens
are what a roomy engine gives; finishing n samples is linear in n; forks waiting for a seat
survive block pressure, a PD hand-off (``kv_handoff.start``) and a re-plan's hand-over."""
import pickle

import pytest

from megainfer.config import CacheConfig, SchedulerConfig
from megainfer.engine import SamplingParams
from megainfer.engine import kv_handoff
from megainfer.engine.block_manager import BlockManager
from megainfer.engine.request import Request
from megainfer.engine.request_queue import RequestQueue
from megainfer.engine.scheduler import Scheduler
from megainfer.runtime.replan.requests import hand_out, take_in
from test_sampling_params_vllm import _prompt, make_engine

SEEDED = SamplingParams(n=10, temperature=0.9, max_tokens=6, ignore_eos=True, seed=3)
GREEDY = SamplingParams(n=10, temperature=0, max_tokens=6, ignore_eos=True)
UNSEEDED = SamplingParams(n=7, temperature=1.0, max_tokens=5, ignore_eos=True)
PARAMS = {"seeded": SEEDED, "greedy": GREEDY, "unseeded": UNSEEDED}


def as_sent(obj):
    """``obj`` as the receiving rank gets it (mpi4py pickles what it sends): our own test
    objects, never outside input."""
    return pickle.loads(pickle.dumps(obj))


def _run(eng, max_steps=2000):
    """Step until done (bounded: a stall fails), the outputs by request id."""
    outs = {}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return outs
        outs.update((o.request_id, o) for o in eng.step())
    raise AssertionError(f"not done after {max_steps} steps")


def _tokens(outs):
    return {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items()}


def _add(eng, params):
    eng.add_request("wide", _prompt(10), params)
    eng.add_request("after", _prompt(7, 1), SamplingParams(n=2, temperature=0.8, max_tokens=4,
                                                          seed=9))


def _reference(params):
    eng, _ = make_engine(max_num_seqs=64, budget=64)
    _add(eng, params)
    return _tokens(_run(eng))


def _check_done(eng, fake, cap):
    assert max(s.num_seqs for s in fake.steps) <= cap
    assert not eng.has_unfinished() and eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("kind", list(PARAMS))
def test_forks_beyond_max_num_seqs_wait_and_sample_the_same(kind):
    want = _reference(PARAMS[kind])
    eng, fake = make_engine(max_num_seqs=4)
    _add(eng, PARAMS[kind])
    outs = _run(eng)
    assert _tokens(outs) == want
    assert [c.index for c in outs["wide"].outputs] == list(range(PARAMS[kind].n))
    assert eng.num_computed_prompt_tokens == 10 + 7  # the forks waited with the prompt's KV
    _check_done(eng, fake, 4)


def test_tiny_model_n_above_max_num_seqs_equals_a_roomy_engine(tmp_path):
    from megainfer import LLM
    from megainfer.tools.make_tiny import make_tiny
    ckpt = make_tiny("mixtral", str(tmp_path / "m"), seed=1, chat_template=False)
    ps = [{"prompt_token_ids": [t % 250 for t in _prompt(9, k)]} for k in range(2)]  # vocab 256
    params = [SamplingParams(n=9, temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(n=9, temperature=1.0, max_tokens=5, ignore_eos=True, seed=2)]
    got = []
    for cap in (3, 32):
        llm = LLM(ckpt, max_model_len=64, max_num_seqs=cap, max_num_batched_tokens=32)
        got.append([[c.token_ids for c in o.outputs]
                    for o in llm.generate(ps, params, use_tqdm=False)])
        assert not llm.engine.has_unfinished()
    assert got[0] == got[1]
    assert len({tuple(t) for t in got[0][1]}) > 1  # seeded samples differ


def test_waiting_forks_under_block_pressure():
    """A pool so small that running samples and waiting forks are preempted: the same tokens,
    nothing stalls, every block comes back."""
    p = SamplingParams(n=10, temperature=0.9, max_tokens=14, ignore_eos=True, seed=3)
    want = _reference(p)
    eng, fake = make_engine(max_num_seqs=4, num_blocks=9, max_model_len=32)
    _add(eng, p)
    assert _tokens(_run(eng)) == want
    assert eng.num_preemptions > 0
    _check_done(eng, fake, 4)


def test_a_running_sample_short_of_blocks_preempts_waiting_forks():
    """One seat, a pool just the prompt's size: the head's first decode must copy the shared
    last block, so the forks waiting for a seat give their references back (newest first)."""
    p = SamplingParams(n=3, temperature=0.9, max_tokens=2, ignore_eos=True, seed=5)
    ref, _ = make_engine()
    ref.add_request("a", _prompt(14), p)
    want = _tokens(_run(ref))
    eng, fake = make_engine(max_num_seqs=1, num_blocks=4, max_model_len=16)
    eng.add_request("a", _prompt(14), p)
    eng.step()
    assert len(eng.scheduler.forked) == 2
    eng.step()
    assert eng.num_preemptions == 2 and [r.index for r in eng.scheduler.waiting] == [1, 2]
    assert _tokens(_run(eng)) == want
    _check_done(eng, fake, 1)


def test_forks_holding_the_whole_pool_do_not_stall():
    """Nothing running, three forks share a full pool's blocks, the first needs a copy of the
    shared last block: the newest forks give theirs back (recompute) until it fits."""
    blocks = BlockManager(4, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=16), blocks)
    head = Request(0, "r", None, list(range(3, 17)), SamplingParams(), seed=0)  # 14 tokens
    assert blocks.allocate(head, 14) and blocks.num_free_blocks == 0
    sched.add_running(head)
    forks = [Request(1 + i, "r", None, head.prompt_token_ids, SamplingParams(), seed=0, index=1 + i)
             for i in range(3)]
    for f in forks:
        blocks.fork(head, f)
        f.num_computed_tokens, f.output_token_ids = 14, [5]
        sched.add_running(f)
    assert list(sched.forked) == forks
    sched.finish(head)
    batch = sched.schedule()
    assert batch.requests == [forks[0]] and batch.preempted == [forks[2], forks[1]]
    assert list(sched.waiting) == [forks[1], forks[2]] and not sched.forked
    assert all(f.num_computed_tokens == 0 and not f.block_table for f in forks[1:])


def test_finishing_n_samples_is_linear(monkeypatch):
    """max_tokens=1: every sample finishes in the step that forks them; the engine's checks of
    ``is_finished`` grow like n (a re-scan of the samples per finish grows like n squared)."""
    calls = [0]
    prop = Request.is_finished

    def counted(self):
        calls[0] += 1
        return prop.fget(self)
    monkeypatch.setattr(Request, "is_finished", property(counted))
    counts = {}
    for n in (2000, 4000):
        eng, _ = make_engine(max_num_seqs=64, num_blocks=64)
        eng.add_request("a", _prompt(10), SamplingParams(n=n, temperature=1.0, max_tokens=1))
        calls[0] = 0
        out = _run(eng)["a"]
        assert len(out.outputs) == n and not eng.has_unfinished()
        counts[n] = calls[0]
    assert counts[4000] < 2.5 * counts[2000], counts


def test_aborting_waiting_forks_frees_everything():
    eng, fake = make_engine(max_num_seqs=4)
    eng.add_request("a", _prompt(10), SamplingParams(n=3000, temperature=1.0, max_tokens=8))
    eng.step()
    eng.step()
    assert len(eng.scheduler.forked) > 2900 and max(s.num_seqs for s in fake.steps) <= 4
    out = eng.abort_request("a")
    assert len(out.outputs) == 3000
    assert not eng.has_unfinished() and eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_pd_start_queues_forks_beyond_max_num_seqs():
    """A prefill engine samples every first token, hands the request over (its forks waiting
    for a seat leave with it); the decode engine runs at most max_num_seqs of them at once."""
    want = _reference(SEEDED)["wide"]
    pre, _ = make_engine(max_num_seqs=4)
    pre.add_request("wide", _prompt(10), SEEDED)
    pre.step()  # the whole prompt: every sample's first token
    head = pre.requests["wide"]
    assert len(pre.scheduler.forked) == 6
    state, kv = kv_handoff.export_state(head), kv_handoff.export_kv(pre, head.block_table)
    kv_handoff.detach(pre, head)
    assert not pre.has_unfinished() and pre.blocks.num_free_blocks == pre.blocks.num_blocks
    dec, fake = make_engine(max_num_seqs=4)
    ph = kv_handoff.reserve(dec, 10, "pd0")
    kv_handoff.import_kv(dec, ph.block_table, kv)
    kv_handoff.start(dec, as_sent(state), ph)
    assert len(dec.scheduler.running) == 4 and len(dec.scheduler.forked) == 6
    assert [c.token_ids for c in _run(dec)["wide"].outputs] == want
    _check_done(dec, fake, 4)


@pytest.mark.parametrize("mode", ["move", "recompute"])
def test_replan_hand_over_carries_waiting_forks(mode):
    want = _reference(SEEDED)
    src, _ = make_engine(max_num_seqs=4)
    _add(src, SEEDED)
    for _ in range(3):
        src.step()
    assert src.scheduler.forked
    out, counts = hand_out(src, {}, [1], mode, 1e9, "[test]")
    assert counts[mode] == 10 and counts["waiting"] == 1  # "after" has not started
    assert not src.has_unfinished() and src.blocks.num_free_blocks == src.blocks.num_blocks
    dst, fake = make_engine(max_num_seqs=4)
    take_in(dst, {}, as_sent(out[1]), "[test]")
    got = _run(dst)
    assert _tokens(got) == want
    _check_done(dst, fake, 4)


def test_request_queue_is_an_ordered_set():
    a, b, c, d = (Request(i, str(i), None, [1], SamplingParams(), seed=0) for i in range(4))
    q = RequestQueue([a, b])
    q.appendleft(c)
    q.extendleft([d])
    q.append(a)  # already queued: stays where it is
    assert list(q) == [d, c, a, b] and (q[0], q[1], q[-1], q[-2]) == (d, c, b, a)
    assert q.discard(c) and not q.discard(c) and c not in q and len(q) == 3
    assert (q.popleft(), q.pop(), list(q)) == (d, b, [a])
    with pytest.raises(IndexError):
        RequestQueue()[0]
