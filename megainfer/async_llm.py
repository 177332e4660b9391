"""``AsyncLLM``: vLLM's ``AsyncLLM`` shape over megainfer's engine core, in every deploy mode.

    engine = AsyncLLM(model, **LLM's arguments)
    async for out in engine.generate(prompt, SamplingParams(...), request_id="r1"):
        ...  # a cumulative RequestOutput each time new tokens exist; finished=True last
    await engine.abort("r1")  # its stream ends with finish_reason "abort"

It owns the frontend side: tokenising in ``generate`` and detokenising (``RequestStream``) on
the event loop's thread, never on the core's; many concurrent ``generate`` calls share one
running batch. The core is a thread of this process (single mode), rank 0 of the runtime, or
a child job (``engine_process=True``). docs/engine.md, "Online: `AsyncLLM` and the engine
core"; docs/python_api.md, "Two ways to run a script" (``on_stats``)."""
from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from typing import Any, AsyncIterator, Callable, Optional

from megainfer.config import ResolvedJob
from megainfer.core_client import Intake, open_core
from megainfer.core_client.client import core_thread
from megainfer.engine.resolve import JobTree
from megainfer.engine import RequestError, RequestOutput, SamplingParams
from megainfer.engine_core.core import SHUTDOWN_TIMEOUT_S
from megainfer.engine_core.messages import AbortRequest, CoreOutputs, OrderReplan
from megainfer.engine.errors import DuplicateRequestError
from megainfer.engine.failures import EngineDeadError, core_died, core_not_running
from megainfer.engine.outputs import PromptInput
from megainfer.core_client.request_stream import RequestStream
from megainfer.llm import LLM


class _LLMArguments(LLM):
    """``LLM``'s argument checks and resolution, nothing built."""

    def __init__(self, model, engine_process: bool, **kwargs):
        self._engine_process = engine_process
        super().__init__(model, **kwargs)

    def _setup(self, resolved, tokenizer) -> None:
        self.resolved, self.tokenizer_arg = resolved, tokenizer


class _Waiter:
    """A request's stream with the event loop its ``generate`` waits on."""

    def __init__(self, stream: RequestStream, loop: asyncio.AbstractEventLoop):
        self.stream, self.loop, self.ready = stream, loop, asyncio.Event()
        self.error: Optional[BaseException] = None


def _weak_deliver(method: weakref.WeakMethod):
    """The core's callback without a strong reference to the ``AsyncLLM``: dropping the last
    reference collects it, and its finalizer ends the core (and the ranks)."""
    def deliver(outs: CoreOutputs) -> None:
        m = method()
        if m is not None:
            m(outs)
    return deliver


class AsyncLLM:
    """Online: ``AsyncLLM(model, **kwargs)`` takes ``LLM``'s arguments (``deploy`` included)."""

    def __init__(self, model, *, engine_process: bool = False,
                 on_stats: Optional[Callable] = None, **kwargs):
        args = _LLMArguments(model, engine_process, **kwargs)
        self._from_job(args.resolved.spec, args.resolved.job, args.tokenizer_arg,
                       engine_process, on_stats)

    @classmethod
    def from_job(cls, spec: JobTree, job: ResolvedJob, engine_process: bool = False,
                 on_stats: Optional[Callable] = None) -> "AsyncLLM":
        """A job resolved already (``spec``: what every rank resolves; ``job``: this process's
        resolution of it), e.g. by megainfer-serve's front door."""
        self = cls.__new__(cls)
        self._from_job(spec, job, None, engine_process, on_stats)
        return self

    def _from_job(self, spec, job, tok, engine_process, on_stats) -> None:
        self.job = job
        self._start(Intake.for_job(job, tok), on_stats, lambda deliver: open_core(
            spec, job, deliver, tok, own_process=engine_process))

    @classmethod
    def from_engine(cls, engine, on_stats: Optional[Callable] = None) -> "AsyncLLM":
        """Serve an existing online engine (``LLM(...).engine``, rank 0's ``RuntimeEngine``)
        with its core on a thread of this process; nothing else may drive it meanwhile."""
        self = cls.__new__(cls)
        self.job = None
        self._start(Intake.of_engine(engine), on_stats,
                    lambda deliver: core_thread(engine, deliver))
        return self

    def _start(self, intake, on_stats, make_core) -> None:
        """``intake``: what opens requests here (tokenises them)."""
        self.intake, self.tokenizer, self.on_stats = intake, intake.tokenizer, on_stats
        self._waiters: dict[str, _Waiter] = {}
        self._lock = threading.Lock()  # _waiters, _pending: the event loops' threads and the core's
        self._pending: dict = {}  # event loop -> [(waiter, update, error)] not applied yet
        self._ids = itertools.count()
        self._dead: Optional[BaseException] = None  # why nothing is accepted any more
        self._error: Optional[BaseException] = None  # what the core died of
        self._core = make_core(_weak_deliver(weakref.WeakMethod(self._deliver)))
        # the engine in this process (single mode; rank 0 under mpiexec), else None
        self.engine = self._core.engine
        self._finalizer = weakref.finalize(self, self._core.shutdown, SHUTDOWN_TIMEOUT_S)  # at exit

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._core.alive

    @property
    def ranks(self) -> tuple:
        """A child job's ranks (``RankInfo``: rank, pid, role); () when the core is here."""
        return self._core.ranks

    def core_busy_s(self) -> float:
        """How long the engine core on this process's thread has been inside one round (0
        while it waits for input; always 0 for a child job's core, whose rank 0 watches it)."""
        return self._core.busy_s()

    def fail(self, error: BaseException) -> None:
        """Declare the engine core dead (a watchdog's verdict on a core that stopped
        answering): every waiting request raises ``error``; nothing more is accepted."""
        self._deliver(CoreOutputs(error=error))

    @property
    def error(self) -> Optional[BaseException]:
        """What the engine core died of (None while it runs, or after ``shutdown``)."""
        return self._error

    # ------------------------------------------------------------------ the API
    async def generate(self, prompt, sampling_params: Optional[SamplingParams] = None,
                       request_id: Any = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request as its tokens come, ``finished=True`` last. A bad
        prompt or parameter raises its ``RequestError`` before anything runs; leaving the loop
        early (break, cancellation) aborts the request."""
        if not self.is_running:
            raise core_not_running(self._dead)
        params = sampling_params or SamplingParams()
        rid = f"async-{next(self._ids)}" if request_id is None else request_id
        inp = PromptInput.of(rid, prompt, params)
        loop = asyncio.get_running_loop()
        if params.structured_outputs is not None:  # compiling its grammar: off the event loop
            add, stream = await loop.run_in_executor(None, self.intake.open, inp)
        else:
            add, stream = self.intake.open(inp)
        key = add.request_id
        waiter = _Waiter(stream, loop)
        with self._lock:
            if key in self._waiters:
                raise DuplicateRequestError(f"request_id={key!r}: already running")
            self._waiters[key] = waiter
        self._core.submit(add)
        try:
            while True:
                await waiter.ready.wait()
                waiter.ready.clear()
                if waiter.error is not None and not waiter.stream.finished:
                    raise core_died(waiter.error) from waiter.error
                out = waiter.stream.output()
                if out.error is not None and out.outputs[0].finish_reason == "error":
                    raise RequestError(out.error)
                yield out
                if out.finished:
                    return
        finally:
            with self._lock:
                self._waiters.pop(key, None)
            if not waiter.stream.finished and self._core.alive:
                self._core.submit(AbortRequest(key))

    async def abort(self, request_id: Any) -> None:
        """End a request wherever it is (waiting, running, partly prefilled): its blocks are
        freed and its stream ends with ``finish_reason="abort"``. Unknown or finished: no-op."""
        self._core.submit(AbortRequest(str(request_id)))

    def order_replan(self, label: str, reason: str) -> None:
        """Switch every rank to ``label`` (``aNeMmK``) at the engine core's next iteration
        (idle or not; a live planner's order; ``replan.enabled=true``)."""
        self._core.submit(OrderReplan(label, reason))

    def shutdown(self, timeout: Optional[float] = SHUTDOWN_TIMEOUT_S) -> None:
        """Abort what runs (those streams end with "abort") and stop the engine core (one
        declared dead by ``fail`` gets a second at most: it may never answer)."""
        self._finalizer.detach()
        self._core.shutdown(timeout if self._error is None else min(1.0, timeout or 1.0))
        self._dead = self._dead or EngineDeadError("shut down")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------ the core's side
    def _deliver(self, outs: CoreOutputs) -> None:
        """On the core's thread: queue the updates for their callers' event loops, no work. A
        loop is woken (one ``call_soon_threadsafe``) only when nothing is queued for it yet: a
        loop that lags takes several iterations' updates in one wake-up."""
        if outs.stats is not None and self.on_stats is not None:
            self.on_stats(outs.stats)
        wake = []
        with self._lock:
            if outs.error is not None:
                self._dead = self._error = outs.error
            for w in self._waiters.values() if outs.error is not None else ():
                wake += self._queue(w.loop, (w, None, outs.error))
            for u in outs.updates:
                w = self._waiters.get(u.request_id)
                if w is not None:
                    wake += self._queue(w.loop, (w, u, None))
        for loop in wake:
            try:
                loop.call_soon_threadsafe(self._drain, loop)
            except RuntimeError:  # that caller's loop is closed: nobody is waiting there
                with self._lock:
                    self._pending.pop(loop, None)

    def _queue(self, loop, item) -> list:
        """(under the lock) -> [loop] when ``loop`` must be woken for its first item."""
        items = self._pending.setdefault(loop, [])
        items.append(item)
        return [loop] if len(items) == 1 else []

    def _drain(self, loop) -> None:
        """On a caller's event loop: detokenise the queued updates into their streams, wake
        the callers."""
        with self._lock:
            items = self._pending.pop(loop, [])
        for w, update, error in items:
            if error is not None:
                w.error = error
                w.ready.set()
            elif not w.stream.finished and w.stream.apply(update):
                w.ready.set()
