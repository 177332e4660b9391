"""The queue time the engine core reports for the runtime (``request_queue_time_seconds``)
includes the time rank 0 held a request before handing it out, not only its replica's queue:
``RuntimeEngine.held_s`` over a stand-in loop that keeps requests pending for a while."""
import time
from types import SimpleNamespace

from megainfer.engine_core.core import EngineCore
from megainfer.engine_core.messages import AddRequest
from megainfer.engine.intake import TokenizedPrompt
from megainfer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from megainfer.engine.sampling_params import SamplingParams
from megainfer.runtime.runtime_engine import RuntimeEngine

REPLICA_QUEUE_S = 0.01


class HoldingLoop:
    """Hands out one pending request per iteration once ``release`` is set; a request handed
    out finishes at the next iteration with its replica's queue time."""

    def __init__(self):
        self.pending, self.running, self.new_tokens, self.statuses = [], [], [], []
        self.release = False
        self.engine = SimpleNamespace(model_config=SimpleNamespace(vocab_size=256))

    def open_online(self, stream=True):
        pass

    def submit(self, inputs):
        self.pending += inputs

    def pending_count(self):
        return len(self.pending)

    def pending_ids(self):
        return {str(p.request_id) for p in self.pending}

    def offload_report(self):
        return None

    def iterate(self):
        done = [RequestOutput(p.request_id, None, p.prompt_token_ids,
                              [CompletionOutput(0, "", [1], "length")], True,
                              RequestMetrics(0.0, 0.0, 0.0, time_in_queue=REPLICA_QUEUE_S))
                for p in self.running]
        self.running = [self.pending.pop(0)] if self.release and self.pending else []
        return done


def _runtime(loop):
    job = SimpleNamespace(comm=SimpleNamespace(timeout_s=8.0))
    rank = SimpleNamespace(loop=loop, role=SimpleNamespace(label="[attn dp0 tp0]"), job=job,
                           feature=None, tracer=SimpleNamespace(enabled=False, cuda=False),
                           replans=[])
    return RuntimeEngine(rank)


def test_the_queue_time_includes_rank_zeros_hold():
    loop = HoldingLoop()
    core = EngineCore(_runtime(loop))
    params = SamplingParams(max_tokens=1)
    for rid in ("a", "b"):
        core.handle(AddRequest(rid, TokenizedPrompt(None, [1, 2], []), params))
    for _ in range(3):  # rank 0 holds both (no replica has room)
        core.step()
        time.sleep(0.05)
    loop.release = True
    while core.has_work():
        core.step()
    queue = core.stats.take().queue_s
    assert len(queue) == 2
    assert all(q > 0.15 + REPLICA_QUEUE_S for q in queue), queue  # held >= 3 x 50 ms
    assert not core.engine.held and not core.engine.arrived  # nothing left behind
