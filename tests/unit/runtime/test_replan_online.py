"""Re-planning online, what needs no ranks: single mode refuses ``replan.enabled`` naming it
(one process has nothing to re-plan); rank 0's controller, stepped for as long as a server
runs, keeps a bounded clock and still measures the last switch's gain."""
import math
from types import SimpleNamespace

import pytest

from megainfer.config import ConfigError, ReplanConfig
from megainfer.runtime.replan.runner import WINDOW, ReplanController


def test_single_mode_refuses_replanning_naming_it(tiny_ckpts):
    from megainfer import LLM
    with pytest.raises(ConfigError, match=r"replan\.enabled=true.*deploy\.mode=single"):
        LLM(tiny_ckpts[("mixtral", "base")], overrides=["replan.enabled=true"])


def _controller(at: int = 10 ** 9):
    job = SimpleNamespace(replan=ReplanConfig(enabled=True, force_schedule=((at, "a2e1"),)),
                          trace=SimpleNamespace(enabled=False),
                          deploy=SimpleNamespace(attention_replicas=1, expert_ranks=2,
                                                 micro_batches=2))
    rank = SimpleNamespace(job=job, replans=[], replan_decisions=[],
                           tracer=SimpleNamespace(events=[]))
    return ReplanController(rank), rank


def _loop(it, running):
    seqs = [SimpleNamespace(num_computed_tokens=5)] * running
    return SimpleNamespace(engine=SimpleNamespace(executor=SimpleNamespace(iteration=it),
                                                  scheduler=SimpleNamespace(running=seqs)),
                           router=SimpleNamespace(replicas=[SimpleNamespace(running=running)]))


def test_the_controllers_clock_stays_bounded_and_measures_the_last_switch():
    ctl, rank = _controller()
    for it in range(40):
        assert ctl.hook(_loop(it, 2), True) is None  # the forced switch is far away
    ctl.switching(None)
    rec = dict(iteration=40, old="a1e2", new="a2e1", reason="forced", seconds=0.1,
               predicted_gain=float("nan"), weight_bytes=0, weight_slots=0, move=0, kv_bytes=0,
               recompute=0, waiting=0, multi=0)
    ctl.switched(rec)
    assert math.isfinite(rec["tokens_per_s_before"])
    for it in range(40, 10_040):  # a server's iterations, idle ones included
        ctl.hook(_loop(it, 4), it < 60)
        assert len(ctl.clock) <= 2 * (WINDOW + 1)
    assert math.isfinite(rec["tokens_per_s_after"]) and "measured_gain" in rec
    assert not ctl.ctx  # forced switches sample nothing
    assert rank.replans == [rec]


def test_a_switch_after_idle_iterations_measures_no_gain():
    """A switch whose window before it ran nothing (a server between bursts: 0 tokens/s) gets
    no measured gain (nan), not a ZeroDivisionError that kills the engine core."""
    ctl, rank = _controller()
    for it in range(5):
        ctl.hook(_loop(it, 0), True)
    ctl.switching(None)
    rec = dict(iteration=5, old="a1e2", new="a2e1", reason="forced", seconds=0.1,
               predicted_gain=float("nan"), weight_bytes=0, weight_slots=0, move=0, kv_bytes=0,
               recompute=0, waiting=0, multi=0)
    ctl.switched(rec)
    assert rec["tokens_per_s_before"] == 0.0
    for it in range(5, 5 + 2 * WINDOW):
        ctl.hook(_loop(it, 3), False)
    ctl.switching(None)  # the next switch closes this one's "after"
    assert rec["tokens_per_s_after"] > 0 and math.isnan(rec["measured_gain"])
    ctl.finish()


def test_a_draining_core_orders_no_switch():
    """Once the engine core's shutdown began (``OnlineReplanner.drain``) a forced switch due
    in its last iterations is not ordered; without the drain it is."""
    from megainfer.runtime.replan.online_plug import OnlineReplanner
    ctl, _ = _controller(at=5)
    assert [ctl.hook(_loop(it, 2), True) for it in range(5)] == [None] * 5
    assert ctl.hook(_loop(5, 2), True).new == (2, 1, 2)
    _, rank = _controller(at=5)
    rank.loop = SimpleNamespace(replan_hook=None)
    plug = OnlineReplanner(rank)
    plug.drain()
    assert [rank.loop.replan_hook(_loop(it, 2), True) for it in range(10)] == [None] * 10


def test_the_core_drains_its_engine_before_the_shutdown_aborts():
    """``EngineCore`` calls the engine's optional ``drain`` first on ``Shutdown``."""
    from megainfer.engine_core.core import EngineCore
    from megainfer.engine_core.messages import Shutdown
    seen = []
    engine = SimpleNamespace(requests={"r": None}, drain=lambda: seen.append("drain"),
                             has_unfinished=lambda: False,
                             abort_request=lambda rid: seen.append(("abort", rid)))
    EngineCore(engine).handle(Shutdown())
    assert seen == ["drain", ("abort", "r")]
