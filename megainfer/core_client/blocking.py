"""``LLM``'s synchronous use of an engine core (every deploy mode but single, which drives its
``LLMEngine`` directly): submit a batch, apply the core's updates to each request's stream
(text decoded here), return when every request has its final output."""
from __future__ import annotations

import queue
import weakref
from typing import Callable, Optional

from megainfer.config import ResolvedJob
from megainfer.engine.core import SHUTDOWN_TIMEOUT_S, AbortRequest, AddRequest, CoreOutputs
from megainfer.engine.outputs import PromptInput, RequestOutput
from megainfer.engine.stream import RequestStream

from .client import JobTree, open_core
from megainfer.engine.errors import EngineDeadError
from .frontend_intake import Intake

POLL_S = 1.0  # how often a waiting generate checks that the core still runs


class BlockingCore:
    def __init__(self, spec: JobTree, job: ResolvedJob, tokenizer=None):
        self.intake = Intake.for_job(job, tokenizer)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.core = open_core(spec, job, self.outbox.put, tokenizer)
        self.dead: Optional[BaseException] = None
        self.num_generated_tokens = 0
        # closed with this object, or at interpreter exit (the ranks never outlive the script)
        self._finalizer = weakref.finalize(self, self.core.shutdown, SHUTDOWN_TIMEOUT_S)

    @property
    def tokenizer(self):
        return self.intake.tokenizer

    def run(self, inputs: list[PromptInput],
            on_finished: Optional[Callable[[RequestOutput], None]] = None
            ) -> dict[str, RequestOutput]:
        """Every input validated first (a bad one raises its ``RequestError`` and nothing
        runs); then all run together. Returns {request id: final output}."""
        if self.dead is not None or not self.core.alive:
            raise EngineDeadError(f"engine core is not running ({self.dead or 'shut down'})")
        tokenized = [self.intake.tokenize(i.prompt, i.params, i.prompt_token_ids)
                     for i in inputs]
        streams = {str(i.request_id): RequestStream(i.request_id, t, i.params, self.tokenizer)
                   for i, t in zip(inputs, tokenized)}
        for i, t in zip(inputs, tokenized):
            self.core.submit(AddRequest(str(i.request_id), t, i.params))
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(streams):
                for u in self._next().updates:
                    s = streams.get(u.request_id)
                    if s is None or s.finished:
                        continue
                    self.num_generated_tokens += sum(len(d.token_ids) for d in u.new_tokens)
                    s.apply(u)
                    if s.finished:
                        out = done[u.request_id] = s.output()
                        if on_finished is not None:
                            on_finished(out)
        except BaseException:
            for rid in streams.keys() - done.keys():  # interrupted: nothing left running
                self.core.submit(AbortRequest(rid))
            raise
        return done

    def _next(self) -> CoreOutputs:
        while True:
            try:
                outs = self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                if not self.core.alive:
                    self.dead = self.dead or EngineDeadError("engine core stopped")
                    raise self.dead
                continue
            if outs.error is not None:
                self.dead = outs.error
                if isinstance(outs.error, EngineDeadError):
                    raise outs.error
                raise EngineDeadError(f"engine core died: {outs.error!r}") from outs.error
            return outs

    def close(self) -> None:
        self._finalizer()

