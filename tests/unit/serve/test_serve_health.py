"""The server's view of a distributed runtime without mpiexec: a stand-in with
``RuntimeEngine``'s members (``load()``, ``idle_interval_s``, ``last_iteration_at``) behind the
real ``ServedEngine`` and engine core thread. Gauges count every replica's sequences (waiting
includes what rank 0 has not handed out); /health's "every rank answers" holds while idle
iterations keep coming and turns false once one hangs past two idle intervals plus an
iteration; the watchdog's error is what the engine core died of."""
import threading
import time

from megainfer.engine.outputs import StepOutputs
from megainfer.engine.stats import EngineLoad
from megainfer.serve.served_engine import MIN_ITERATION_ALLOWANCE_S, ServedEngine


class FakeRuntime:
    """RuntimeEngine's online members; ``hang`` blocks the next iteration until set."""

    idle_interval_s = 0.05
    log_prefix = "[fake]"
    tokenizer, max_model_len, model_config = None, 64, None

    def __init__(self):
        self.requests, self.detokenize = {}, False
        self.last_iteration_at = time.monotonic()
        self.hang, self.release = threading.Event(), threading.Event()
        self.fail = None

    vocab_size, stall_allowance_s = 256, 0.0

    def load(self):
        return EngineLoad(running=3, waiting=2, kv_usage=0.25, not_handed_out=4)

    def held_s(self, request_id):
        return 0.0

    def take_spans(self):
        return None

    def replan_switches(self):
        return []

    def offload_report(self):
        return None

    def hang_after_s(self, timeout_s):
        return timeout_s

    def drain(self):
        pass

    def has_unfinished(self):
        return False

    def step_outputs(self):
        if self.hang.is_set():
            self.release.wait(10)
        if self.fail is not None:
            raise self.fail
        self.last_iteration_at = time.monotonic()
        return StepOutputs()

    def idle_tick(self):
        self.step_outputs()

    def close(self):
        self.release.set()


def _until(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout
        time.sleep(0.01)


def test_runtime_gauges_and_health_follow_the_iterations():
    eng = FakeRuntime()
    client = ServedEngine.beside(eng, "fake", role="disaggregated")
    try:
        load = eng.load()
        assert (load.running, load.queued, load.kv_usage) == (3, 6, 0.25)
        _until(lambda: client.num_running() == 3)  # the core's first stats came
        bound = client.stale_after_s()
        assert bound == 2 * eng.idle_interval_s + MIN_ITERATION_ALLOWANCE_S
        _until(lambda: eng.last_iteration_at > time.monotonic() - 0.2)  # idle ticks run
        assert client.answering()
        eng.hang.set()  # a rank stops answering: the next iteration does not return
        _until(lambda: not client.answering(), timeout=bound + 3)
        assert client.healthy  # the core still runs; only its iterations stopped
        eng.fail = RuntimeError("peer rank 2 timed out")
        eng.release.set()
        _until(lambda: not client.healthy)
        assert str(client.error) == "peer rank 2 timed out"
    finally:
        client.shutdown()


def test_a_core_stuck_in_one_iteration_is_declared_dead():
    """``hang_after_s``: a core on a thread here that stays inside one iteration longer is
    declared dead (health false, the error says it hangs) although its thread lives; without it
    the same hang leaves the core alive (the staleness check above is what /health shows)."""
    eng = FakeRuntime()
    client = ServedEngine.beside(eng, "fake", role="disaggregated", hang_after_s=0.5)
    try:
        _until(lambda: eng.last_iteration_at > time.monotonic() - 0.2)
        assert client.healthy and client.llm.core_busy_s() < 0.5
        eng.hang.set()
        t0 = time.monotonic()
        _until(lambda: not client.healthy, timeout=5)
        assert 0.5 <= time.monotonic() - t0 < 3
        assert "inside one iteration" in str(client.error) and "hangs" in str(client.error)
        assert client.llm.core_busy_s() > 0.5  # the thread itself still sits in the iteration
    finally:
        eng.release.set()
        client.shutdown()
