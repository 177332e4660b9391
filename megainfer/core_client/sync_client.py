"""``LLM``'s synchronous face over an engine core, in every deploy mode, and the offline job's:
requests opened by the frontend's ``Intake`` (tokenised here), submitted, the core's updates
applied to each request's stream (text decoded here), each final output handed on as it comes.

The core is this process's (``InprocClient``: stepped on this thread, single mode and rank 0
of an ``mpiexec`` launch) or a child job's (``ChildJobClient``, whose updates arrive on a reader
thread: ``QueuedOutputs`` waits on them). Either way one ``next_outputs()`` is one batch of
``CoreOutputs``.
"""
from __future__ import annotations

import logging
import queue
from typing import Callable, Iterable, Iterator, Optional

from megainfer.engine_core.messages import AbortRequest, CoreOutputs
from megainfer.engine.errors import RequestError
from megainfer.engine.failures import EngineDeadError, core_died, core_not_running
from megainfer.engine.outputs import PromptInput, RequestOutput
from megainfer.core_client.request_stream import RequestStream

from .request_stream import Intake

log = logging.getLogger("megainfer.core_client")
POLL_S = 1.0  # how often a wait on a child job's core checks that it still runs


class QueuedOutputs:
    """The ``deliver`` callback of a core that runs elsewhere, and the wait for what it
    delivered (``next_outputs``)."""

    def __init__(self):
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.core = None  # set once the core is open (its liveness is checked while waiting)

    def deliver(self, outs: CoreOutputs) -> None:
        if outs.updates or outs.error is not None:  # (the sync face reads no stats)
            self.outbox.put(outs)

    def next_outputs(self) -> CoreOutputs:
        while True:
            try:
                return self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                if not self.core.alive:
                    raise EngineDeadError("engine core stopped") from None


class SyncClient:
    """``core``: a ``CoreClient``; ``next_outputs``: its next batch of outputs (blocking);
    ``final_only``: the core sends no per-step tokens (its engine is in this process)."""

    def __init__(self, core, next_outputs: Callable[[], CoreOutputs], intake: Intake,
                 final_only: bool = False):
        self.core, self.next_outputs, self.intake = core, next_outputs, intake
        self.final_only = final_only
        self.engine = core.engine  # the engine when it is in this process, else None
        self.dead: Optional[BaseException] = None
        self.num_generated_tokens = 0  # so far (final-only: of the finished outputs)

    @property
    def tokenizer(self):
        return self.intake.tokenizer

    def generate(self, inputs: list[PromptInput],
                 on_finished: Optional[Callable[[RequestOutput], None]] = None
                 ) -> dict[str, RequestOutput]:
        """Every input validated first (a bad one raises its ``RequestError`` and nothing
        runs); then all run together. Returns {request id: final output}."""
        self._check_running()
        opened = [self.intake.open(i) for i in inputs]
        done: dict[str, RequestOutput] = {}
        for out in self._run(opened):
            done[str(out.request_id)] = out
            if on_finished is not None:
                on_finished(out)
        return done

    def generate_stream(self, inputs: Iterable[PromptInput]) -> Iterator[RequestOutput]:
        """Each output as its request finishes; an invalid input is at once a failed output
        (finish_reason "error") naming the culprit, and the others run."""
        self._check_running()
        opened = []
        for inp in inputs:
            try:
                opened.append(self.intake.open(inp))
            except RequestError as e:
                log.warning("%s request %r refused: %s", self._prefix(), inp.request_id, e)
                yield RequestOutput.failed(inp.request_id, inp.prompt, inp.prompt_token_ids, e)
        yield from self._run(opened)

    def _run(self, opened: list) -> Iterator[RequestOutput]:
        streams: dict[str, RequestStream] = {}
        for add, stream in opened:
            if add.request_id in streams:
                raise RequestError(f"request_id={add.request_id!r}: given twice")
            streams[add.request_id] = stream
        for add, _ in opened:
            self.core.submit(add)
        left = len(streams)
        try:
            while left:
                for u in self._next().updates:
                    s = streams.get(u.request_id)
                    if s is None or s.finished:
                        continue
                    self.num_generated_tokens += sum(len(d.token_ids) for d in u.new_tokens)
                    s.apply(u)
                    if s.finished:
                        left -= 1
                        out = s.output()
                        if self.final_only:
                            self.num_generated_tokens += sum(len(c.token_ids)
                                                             for c in out.outputs)
                        yield out
        finally:  # interrupted (an error, or the caller stopped reading): nothing left running
            if left and self.core.alive:
                for rid, s in streams.items():
                    if not s.finished:
                        self.core.submit(AbortRequest(rid))

    def _next(self) -> CoreOutputs:
        try:
            outs = self.next_outputs()
        except Exception as e:  # the in-process engine's own error (as it is), or a stop
            self.dead = self.dead or e
            raise
        if outs.error is not None:
            self.dead = outs.error
            raise core_died(outs.error) from outs.error
        return outs

    def _check_running(self) -> None:
        if self.dead is not None or not self.core.alive:
            raise core_not_running(self.dead)

    def _prefix(self) -> str:
        return self.engine.log_prefix if self.engine is not None else "[frontend]"

    def close(self, timeout: Optional[float] = None) -> None:
        self.core.shutdown(timeout)
