"""Rank 0's PD hand-out under aborts (``PDRouter.abort``), on one process: the prefill rank is
this process (``COMM_SELF``), its reports are sent to itself. An abort while the request is on
the prefill rank ends it at once and turns the prefill's later report into a ``Drop`` (the
decode replica takes the KV and frees its blocks), never a ``Start``; an abort of a request
that decodes names its replica."""
from types import SimpleNamespace

from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy
from megainfer.config import CacheConfig, SchedulerConfig
from megainfer.engine.outputs import PromptInput, SampleDelta
from megainfer.engine.sampling_params import SamplingParams
from megainfer.runtime import tags
from megainfer.runtime.messages import Drop, Expect, PrefillReport, PrefillResult, Start, WorkItem
from megainfer.runtime.pd.router import PDRouter


def _router():
    engine = SimpleNamespace(tokenizer=None, model_config=SimpleNamespace(vocab_size=100),
                             max_model_len=64, scheduler_config=SchedulerConfig(max_num_seqs=4),
                             cache_config=CacheConfig(block_size=4, num_blocks=64))
    return PDRouter(MPI.COMM_SELF, [0], 1, engine, "[attn dp0 tp0]", WaitPolicy(timeout_s=5))


def _state(rid):
    return SimpleNamespace(request_id=rid, index=0, output_token_ids=[7], logprobs=None,
                           finish_reason=None, stop_reason=None, samples=[])


def _handed_out(router, rid):
    router.add([PromptInput(rid, prompt_token_ids=[1, 2, 3], params=SamplingParams(n=2))])
    msgs, done = router.iterate([0])
    assert not done and [type(m) for m in msgs[0]] == [Expect]
    work = MPI.COMM_SELF.recv(source=0, tag=tags.PD_WORK)  # what the prefill rank would get
    router.outbox.flush()
    item: WorkItem = work.items[0]
    assert str(item.input.request_id) == rid
    return item.xfer


def _report(xfer, rid):
    """The prefill rank's report (non-blocking: the receive is rank 0's, in ``iterate``)."""
    return MPI.COMM_SELF.isend(PrefillReport([PrefillResult(xfer, "state", _state(rid))], 0, 0),
                               dest=0, tag=tags.PD_DONE)


def test_abort_on_the_prefill_rank_ends_it_now_and_drops_its_kv_later():
    r = _router()
    xfer = _handed_out(r, "a")
    out, replica = r.abort("a")
    assert replica is None and out.finished and len(out.outputs) == 2
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    sent = _report(xfer, "a")
    msgs, done = r.iterate([0])
    sent.wait()
    assert msgs[0] == [Drop(xfer, True)] and not done  # no Start, no second output
    assert not r.take_first_tokens() and not r.busy and "a" not in r.decoding


def test_abort_of_a_decoding_request_names_its_replica():
    r = _router()
    xfer = _handed_out(r, "b")
    sent = _report(xfer, "b")
    msgs, done = r.iterate([0])
    sent.wait()
    assert [type(m) for m in msgs[0]] == [Start] and not done
    assert r.take_first_tokens() == [SampleDelta("b", 0, [7])]  # sampled on the prefill rank
    assert r.abort("b") == (None, 0)


def test_abort_before_the_hand_out_and_of_an_unknown_request():
    r = _router()
    r.add([PromptInput("c", prompt_token_ids=[1, 2], params=SamplingParams())])
    out, replica = r.abort("c")
    assert replica is None and out.outputs[0].finish_reason == "abort" and not r.busy
    assert r.abort("nobody") == (None, None)
