"""PD's decode attention offload on /metrics (``pd.offload``): the engine core's recorder takes
``OnlineEngine.offload_report`` at each ``take`` (the requests offloaded since as a count, the
round trips, the offloaded-now figure; a change of that alone is sent; None from an engine
without offload leaves it None), and the frontend renders ``num_requests_offloaded``,
``offloaded_requests_total``, ``offload_returned_home_total`` and
``offload_round_trip_seconds``. The served path under
mpiexec: tests/distributed/test_serve_offload.py."""
from prometheus_client import generate_latest

from megainfer.engine.stats import CoreStatsRecorder, EngineLoad
from megainfer.runtime.messages import OffloadStatus
from megainfer.serve.metrics import CoreWatch, ServeMetrics

LAB = '{model_name="tiny"}'


class _Engine:
    """The recorder's view of an ``OnlineEngine``; ``report``: its next offload_report."""

    idle_interval_s, stall_allowance_s = 0.5, 0.0

    def __init__(self, report=None):
        self.report = report

    def load(self):
        return EngineLoad(1, 0, 0.5)

    def offload_report(self):
        return self.report


def _sample(text: str, name: str):
    line = next((x for x in text.splitlines() if x.startswith(name + " ")), None)
    return None if line is None else float(line.rsplit(" ", 1)[1])


def test_recorder_takes_the_offload_report():
    eng = _Engine(OffloadStatus(1, 2, (0.001, 0.002)))
    rec = CoreStatsRecorder(eng)
    got = rec.take()
    assert (got.offloaded, got.offloaded_requests, got.offload_round_trip_s) == \
        (1, 2, [0.001, 0.002])
    eng.report = OffloadStatus(1, 2, ())
    assert rec.take() is None  # nothing changed
    eng.report = OffloadStatus(0, 2, ())  # the request left its prefill rank: the gauge alone
    got = rec.take()
    assert (got.offloaded, got.offloaded_requests, got.offload_round_trip_s) == (0, 0, [])
    eng.report = OffloadStatus(2, 5, (0.003,))
    assert rec.take().offloaded_requests == 3  # the requests offloaded since the last
    plain = CoreStatsRecorder(_Engine(None))  # single mode, PD without offload
    got = plain.take()
    assert got.offloaded is None and got.offloaded_requests == 0 and not got.offload_round_trip_s


def test_offload_metrics_render():
    m = ServeMetrics("tiny")
    watch = CoreWatch(m, "pd")
    eng = _Engine()
    rec = CoreStatsRecorder(eng)
    text = generate_latest(m.registry).decode()
    assert _sample(text, f"megainfer:num_requests_offloaded{LAB}") == 0  # before any report
    assert _sample(text, f"megainfer:offloaded_requests_total{LAB}") is None  # no sample yet
    assert _sample(text, f"megainfer:offload_round_trip_seconds_count{LAB}") is None
    for report in (OffloadStatus(1, 1, (0.002, 0.003)), OffloadStatus(2, 3, (0.02,), 1)):
        eng.report = report
        watch.apply(rec.take())
    text = generate_latest(m.registry).decode()
    assert _sample(text, f"megainfer:num_requests_offloaded{LAB}") == 2
    assert _sample(text, f"megainfer:offloaded_requests_total{LAB}") == 3
    assert _sample(text, f"megainfer:offload_round_trip_seconds_count{LAB}") == 3
    assert abs(_sample(text, f"megainfer:offload_round_trip_seconds_sum{LAB}") - 0.025) < 1e-12
    assert _sample(text, 'megainfer:offload_round_trip_seconds_bucket{le="0.0025",'
                   'model_name="tiny"}') == 1
    assert _sample(text, f"megainfer:offload_returned_home_total{LAB}") == 1
    assert "# TYPE megainfer:num_requests_offloaded gauge" in text
    assert "# TYPE megainfer:offloaded_requests_total counter" in text
    assert "# TYPE megainfer:offload_round_trip_seconds histogram" in text
    eng.report = OffloadStatus(0, 3, (), 3)
    watch.apply(rec.take())
    text = generate_latest(m.registry).decode()
    assert _sample(text, f"megainfer:num_requests_offloaded{LAB}") == 0
    assert _sample(text, f"megainfer:offload_returned_home_total{LAB}") == 3  # 2 more since
    assert _sample(text, f"megainfer:offloaded_requests_total{LAB}") == 3
    eng.report = None  # stats without the figure (None) leave the gauge as it was
    got = rec.take()
    assert got.offloaded is None
    watch.apply(got)
    assert watch.offloaded == 0
