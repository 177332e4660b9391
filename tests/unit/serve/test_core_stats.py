"""What the engine core measures about itself (``engine.stats``) and what the frontend
makes of it (``serve.metrics.CoreWatch``): each iteration timed, generated tokens counted, each
finished request's queue time (arrival -> first scheduled step) taken from its output, the
queues as they are after every input or iteration (an abort while idle too), nothing sent when
nothing changed; and rank 0's T_c matched from late expert reports (``runtime.span_report``)."""
import time
from types import SimpleNamespace

from prometheus_client import generate_latest

from megainfer import LLM, SamplingParams
from megainfer.engine_core.core import EngineCore
from megainfer.engine_core.messages import AbortRequest, AddRequest
from megainfer.perfmodel.trace import A2E, complete_event, wait_name
from megainfer.runtime.messages import ExpertSpans
from megainfer.runtime.span_report import PipelineSpans
from megainfer.serve.metrics import CoreWatch, ServeMetrics


def _sample(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name))
    return float(line.rsplit(" ", 1)[1])


def test_recorder_times_iterations_counts_tokens_and_queue_times(tiny_ckpts):
    llm = LLM(tiny_ckpts[("qwen3_moe", "base")], max_model_len=64, max_num_seqs=2,
              num_blocks=64, block_size=4)
    eng = llm.engine
    core = EngineCore(eng)
    rec = core.stats
    assert rec.take().load.running == 0  # the first call: the queues as they are
    assert rec.take() is None  # nothing happened since
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for i in range(3):  # 3 requests, 2 seats: the third waits for one
        core.handle(AddRequest(f"r{i}", eng.tokenize(f"ab{i}", params), params))
    first = rec.take()
    assert first.load.waiting == 3 and first.iterations == 0
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
    got = rec.take()
    assert len(got.iteration_s) == steps and all(s > 0 for s in got.iteration_s)
    assert got.generated_tokens == 15 and got.load.running == got.load.waiting == 0
    assert len(got.queue_s) == 3 and all(q >= 0 for q in got.queue_s)
    assert max(got.queue_s) > min(got.queue_s)  # the third waited for a seat
    core.handle(AddRequest("late", eng.tokenize("xy", params), params))
    core.step()
    assert rec.take().load.running == 1
    core.handle(AbortRequest("late"))  # an abort while idle: the queues are sent again
    after = rec.take()
    assert after.load.running == 0 and after.iterations == 0


def test_core_watch_feeds_gauges_histograms_and_the_iteration_clock(tiny_ckpts):
    llm = LLM(tiny_ckpts[("qwen3_moe", "base")], max_model_len=64, num_blocks=64, block_size=4)
    core = EngineCore(llm.engine)
    rec = core.stats
    m = ServeMetrics("tiny")
    watch = CoreWatch(m, "single")
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    core.handle(AddRequest("a", llm.engine.tokenize("abc", p), p))
    core.step()
    before = watch.last_iteration_at
    time.sleep(0.01)
    watch.apply(rec.take())
    assert watch.load.running == 1 and watch.last_iteration_at > before
    assert watch.slowest_recent_s() > 0 and watch.idle_interval_s is None
    while core.has_work():
        core.step()
    watch.apply(rec.take())
    text = generate_latest(m.registry).decode()
    assert _sample(text, 'megainfer:num_requests_running{model_name="tiny"}') == 0
    assert _sample(text, 'megainfer:generation_tokens_total{model_name="tiny"}') == 3
    assert _sample(text, 'megainfer:request_queue_time_seconds_count{model_name="tiny"}') == 1
    assert _sample(text, 'megainfer:iteration_time_seconds_count{model_name="tiny",'
                   'role="single"}') == 3


class _Tracer:
    enabled, cuda = True, False

    def __init__(self):
        self.events = []


class _Comm:
    """The job communicator as rank 0's reader sees it: queued expert reports."""

    def __init__(self):
        self.inbox = []

    def iprobe(self, tag):
        return bool(self.inbox)

    def recv(self, tag):
        return self.inbox.pop(0)


class _Control:
    """Rank 0's control plane as the reader's close sees it: each rank's reports, in order."""

    def __init__(self, reports: dict):
        self.reports = reports

    def recv(self, src, tag, phase):
        return self.reports[src].pop(0)


class _Rank:
    def __init__(self, reports=None):
        self.comm, self.tracer = _Comm(), _Tracer()
        self.control = _Control(reports or {})
        self.job = SimpleNamespace(trace=SimpleNamespace(enabled=reports is not None))


def test_rank_zero_matches_late_expert_reports_to_its_dispatches():
    r = _Rank()
    spans = PipelineSpans(r)
    # rank 0 dispatched (iteration 0, layer 1, mb 0) ending at t=100 us, (0, 1, 1) at 300 us
    for mb, end in ((0, 100.0), (1, 300.0)):
        r.tracer.events.append(complete_event(0, A2E, 1, f"A2E L1 mb{mb}", end - 10, 10, 0, 1,
                                              mb, 4))
    assert spans.take().comm_s == []  # no report yet: nothing to match
    r.comm.inbox.append(ExpertSpans(1, [2e-3, 3e-3], [((0, 1, 0), 150.0), ((0, 1, 1), 290.0),
                                                      ((5, 1, 0), 999.0)]))
    got = spans.take()  # a report one iteration late still finds its dispatch
    assert got.expert_s == [2e-3, 3e-3]
    assert got.comm_s == [50e-6]  # (0,1,1) arrived before its dispatch ended: no wait seen
    r.tracer.events.append(complete_event(1, A2E, 1, wait_name(A2E, 1, 0), 0, 5, 9, 1, 0, 4))
    assert spans.take().comm_s == []  # an expert rank's own wait span is not a dispatch


def test_rank_zero_closes_after_every_ranks_last_report():
    reports = {1: [ExpertSpans(1, [1e-3]), ExpertSpans(1, last=True)],
               2: [ExpertSpans(2, last=True)]}
    r = _Rank(reports)
    r.comm.Get_size = lambda: 3
    PipelineSpans(r).close()
    assert reports == {1: [], 2: []}  # nothing left for MPI_Finalize to find
