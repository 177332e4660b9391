"""The engine core: one ``OnlineEngine`` driven by typed messages between its iterations.

``EngineCore`` is synchronous (no threads; the in-process client, ``EngineCoreThread`` and
tests drive it): ``round`` takes the inputs that came (``messages.py``), runs one iteration when
there is work and gives one ``CoreOutputs``. Prompts arrive tokenized (the client's
``Intake``) and outputs leave without text (the client's ``RequestStream`` decodes), so
neither runs on the core's loop, except what decides a request's end: stop strings are
matched by the engine (``Request.append_token``), and logprob entries carry their token text.
``EngineCoreThread`` runs that loop on a background thread (sleeping while idle), as vLLM v1's
``EngineCoreProc`` runs its busy loop; the code is megainfer's own. docs/engine.md, "Online".
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional, Protocol

from megainfer.engine.errors import RequestError
from megainfer.engine.intake import TokenizedPrompt
from megainfer.engine.outputs import RequestOutput, StepOutputs
from megainfer.engine.sampling_params import SamplingParams
from megainfer.engine.stats import CoreStatsRecorder, EngineLoad, timed

from .messages import (AbortRequest, AddRequest, CoreInput, CoreOutputs, OrderReplan,
                       RequestUpdate, Shutdown)

log = logging.getLogger("megainfer.engine_core")


class OnlineEngine(Protocol):
    """What ``EngineCore`` needs of its engine: ``LLMEngine`` in single mode; in every other
    mode rank 0 of the runtime (``megainfer.runtime.runtime_engine.RuntimeEngine``).

    An abort may end a request later than the call (the runtime's rank 0 tells the replica
    holding it; its final output comes with a later ``step_outputs``). ``idle_interval_s``: not
    None when the engine must be stepped (``idle_tick``) at least that often while idle (the
    runtime's ranks watch each other with timeouts); ``drain``: a shutdown began, only the
    iterations that end the aborted requests follow (the runtime stops re-planning); ``close``:
    end it (its ranks too). What the core's ``CoreStatsRecorder`` reads: ``load``, ``held_s``
    (how long the engine held a finished request before its queue time began: rank 0's
    hand-out), ``take_spans`` (T_a / T_e / T_c since the last call, or None), ``replan_switches``
    ((who ordered it, seconds) of every re-plan so far),
    ``offload_report`` (PD's decode attention offload: a ``runtime.messages.OffloadStatus``,
    its round trips since the last call; None without ``pd.offload``, single mode too),
    ``stall_allowance_s``; a watchdog reads ``hang_after_s``."""

    requests: dict  # unfinished requests by id
    detokenize: bool  # False: final outputs leave without text (the frontend decodes)
    stream_tokens: bool  # False: only finished outputs needed (the runtime's replicas then
    # send rank 0 no per-step tokens); set by the core before its first iteration
    log_prefix: str
    idle_interval_s: Optional[float]
    stall_allowance_s: float  # how much longer than its slowest an iteration may take
    vocab_size: int
    max_model_len: int

    def tokenize(self, prompt, params: SamplingParams, prompt_token_ids=None
                 ) -> TokenizedPrompt: ...

    def add_tokenized(self, request_id, prompt: TokenizedPrompt, params: SamplingParams): ...

    def abort_request(self, request_id) -> Optional[RequestOutput]: ...

    def step_outputs(self) -> StepOutputs: ...

    def has_unfinished(self) -> bool: ...

    def idle_tick(self) -> None: ...

    def load(self) -> EngineLoad: ...

    def held_s(self, request_id) -> float: ...

    def take_spans(self): ...

    def replan_switches(self) -> list[tuple[str, float]]: ...

    def order_replan(self, label: str, reason: str) -> None: ...  # a live planner's switch

    def offload_report(self): ...

    def hang_after_s(self, timeout_s: float) -> float: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...


# at shutdown, iterations to wait for the aborted requests' last outputs (the runtime's
# replicas answer an abort at their next iteration)
SHUTDOWN_ITERATIONS = 64
# how long a client waits for an engine core's shutdown (its last outputs; a child job's exit,
# after which it is killed): AsyncLLM, LLM's SyncClient and the spawned core alike (the
# 30 s they waited before; a served child job's exit is bounded by it under SIGTERM)
SHUTDOWN_TIMEOUT_S = 30.0


class EngineCore:
    """One ``OnlineEngine`` behind the message interface (synchronous); ``stats`` records what
    its iterations measure. ``stream``: each iteration's new tokens go out as updates (a
    streaming frontend: ``AsyncLLM``, the server); False: only final outputs (``LLM``, the
    offline job: no per-token work on the core's loop). Either way the engine makes no text
    (the frontend decodes, ``RequestStream``)."""

    def __init__(self, engine: OnlineEngine, stream: bool = True):
        self.engine, self.stream = engine, stream
        engine.detokenize = False
        engine.stream_tokens = stream
        self.stats = CoreStatsRecorder(engine)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def round(self, msgs: list[CoreInput], idle: bool = False) -> tuple[CoreOutputs, bool]:
        """One round of the core's loop: the inputs in order (those after a ``Shutdown``
        dropped), then one iteration when there is work (``idle``: none came in the idle
        interval, so an ``idle_tick``). Returns (its outputs, whether a ``Shutdown`` ended
        the loop)."""
        updates, stop = [], False
        for msg in msgs:
            updates += self.handle(msg)
            if isinstance(msg, Shutdown):
                stop = True
                break
        if not stop and self.has_work():
            updates += self.step()
        elif not stop and idle:
            self.idle_tick()  # nothing came for the idle interval: keep the ranks' watch
        return CoreOutputs(updates, stats=self.stats.take()), stop

    def handle(self, msg: CoreInput) -> list[RequestUpdate]:
        """Apply one input between iterations; updates for refused or aborted requests."""
        eng = self.engine
        if isinstance(msg, AddRequest):
            try:
                eng.add_tokenized(msg.request_id, msg.prompt, msg.params)
            except RequestError as e:
                log.warning("%s request %r refused: %s", eng.log_prefix, msg.request_id, e)
                return [RequestUpdate(msg.request_id, output=RequestOutput.failed(
                    msg.request_id, msg.prompt.prompt, msg.prompt.prompt_token_ids, e))]
            return []
        if isinstance(msg, AbortRequest):
            out = eng.abort_request(msg.request_id)  # None: finished already, or unknown
            return [] if out is None else [RequestUpdate(msg.request_id, output=out)]
        if isinstance(msg, OrderReplan):
            eng.order_replan(msg.label, msg.reason)
            return []
        if isinstance(msg, Shutdown):
            eng.drain()
            updates = [u for rid in list(eng.requests) for u in self.handle(AbortRequest(rid))]
            for _ in range(SHUTDOWN_ITERATIONS):
                if not eng.has_unfinished():
                    break
                updates += self.step()
            return updates
        raise TypeError(f"engine core input {msg!r}: not an AddRequest, AbortRequest, "
                        "OrderReplan or Shutdown")

    def step(self) -> list[RequestUpdate]:
        """One iteration; one update per request with new tokens (``stream``) or a final
        output."""
        seconds, res = timed(self.engine.step_outputs)
        self.stats.iteration(seconds, res)
        by_id: dict[str, RequestUpdate] = {}
        for d in res.new_tokens if self.stream else ():
            u = by_id.get(d.request_id)
            if u is None:
                u = by_id[d.request_id] = RequestUpdate(d.request_id)
            u.new_tokens.append(d)
        for out in res.finished:
            by_id.setdefault(out.request_id, RequestUpdate(out.request_id)).output = out
        return list(by_id.values())

    def idle_tick(self) -> None:
        """An empty iteration of every rank (timed like any): their watch stays alive."""
        seconds, _ = timed(self.engine.idle_tick)
        self.stats.idle_tick(seconds)


class EngineCoreThread:
    """``EngineCore``'s loop in a background thread: inputs through ``submit`` (any thread),
    each iteration's updates to ``deliver`` (called on this thread: hand them on, do no work).
    Idle, the thread blocks on its input queue (no CPU). A crash in the loop is delivered as
    ``CoreOutputs.error`` and ends the thread. What the core measured since the last round
    (``EngineCore.stats``) goes as ``CoreOutputs.stats`` after each round of inputs and
    iteration that produced updates or measurements."""

    ranks: tuple = ()  # a ``CoreClient``: no child job's ranks

    def __init__(self, core: EngineCore, deliver: Callable[[CoreOutputs], None],
                 name: str = "megainfer-engine-core"):
        self.core, self.deliver = core, deliver
        self.engine = core.engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.error: Optional[BaseException] = None
        self.busy_since: Optional[float] = None  # monotonic start of this round; None: idle
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def busy_s(self) -> float:
        """How long the loop has been inside its current round (its inputs, one iteration,
        the delivery of its outputs); 0 while it waits for input."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def submit(self, msg: CoreInput) -> None:
        self.inbox.put(msg)

    def shutdown(self, timeout: Optional[float] = None) -> None:
        if self.thread.is_alive():
            self.submit(Shutdown())
            self.thread.join(timeout)

    def _run(self) -> None:
        engine = self.core.engine
        idle_s = engine.idle_interval_s
        try:
            stop = False
            while not stop:
                self.busy_since = None
                msgs = self._take(block=not self.core.has_work(), timeout=idle_s)  # idle: sleep
                self.busy_since = time.monotonic()
                outs, stop = self.core.round(msgs, idle=not msgs and idle_s is not None)
                if outs.updates or outs.stats is not None:
                    self.deliver(outs)
        except BaseException as e:  # noqa: BLE001 - delivered: every waiting caller gets it
            self.error = e
            log.exception("%s engine core loop died", engine.log_prefix)
            self.deliver(CoreOutputs(error=e))
        finally:
            engine.close()  # on this thread: the runtime's MPI calls stay on one thread

    def _take(self, block: bool, timeout: Optional[float] = None) -> list[CoreInput]:
        """Every input queued now (waiting up to ``timeout`` for the first one when
        ``block``)."""
        msgs = []
        if block:
            try:
                msgs.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return msgs
        while True:
            try:
                msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                return msgs
