"""The engine core's recorder (``engine.stats.CoreStatsRecorder``) counts each re-plan switch
once, whether it ran in an iteration with work or in an idle keep-alive tick (a live planner's
order that arrives after the traffic ends is carried out in a tick, and /metrics must show it
then, not at the next request)."""
from megainfer.engine.stats import CoreStatsRecorder, EngineLoad
from megainfer.engine.outputs import StepOutputs


class _Engine:
    """The recorder's view of an ``OnlineEngine``; ``switches``: its re-plans so far."""

    idle_interval_s, stall_allowance_s = 0.5, 0.0

    def __init__(self):
        self.switches: list[tuple[str, float]] = []

    def load(self):
        return EngineLoad(0, 0, 0.0)

    def offload_report(self):
        return None

    def take_spans(self):
        return None

    def replan_switches(self):
        return list(self.switches)


def test_a_switch_in_an_idle_tick_is_counted_then_and_once():
    eng = _Engine()
    rec = CoreStatsRecorder(eng)
    rec.take()
    eng.switches.append(("planner", 0.2))  # carried out by the keep-alive tick
    rec.idle_tick(0.25)
    got = rec.take()
    assert (got.replans, got.replan_switch_s, got.idle_tick_s) == (1, [("planner", 0.2)], [0.25])
    rec.iteration(0.01, StepOutputs())  # the next iteration: no second count
    assert rec.take().replans == 0
    eng.switches.append(("forced", 0.1))
    rec.iteration(0.01, StepOutputs())
    got = rec.take()
    assert (got.replans, got.replan_switch_s) == (1, [("forced", 0.1)])
