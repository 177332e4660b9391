"""The in-process client: the engine core stepped on the caller's own thread, no thread and no
socket (vLLM's ``InprocClient``). ``LLM`` uses it wherever the engine is in this process
(single mode; rank 0 of an ``mpiexec`` launch) and so does ``megainfer-launch``'s offline job:
inputs queue in ``submit``; ``next_outputs`` runs one round of the core (the queued inputs,
then one iteration) and returns what it gave."""
from __future__ import annotations

from typing import Optional

from megainfer.engine_core.core import EngineCore
from megainfer.engine_core.messages import CoreInput, CoreOutputs, Shutdown


class InprocClient:
    """Each round's ``CoreStats`` are dropped (the sync face reads none)."""

    ranks: tuple = ()  # no child job

    def __init__(self, core: EngineCore):
        self.core, self.engine = core, core.engine
        self.inbox: list[CoreInput] = []
        self.closed = False
        self.error: Optional[BaseException] = None

    @property
    def alive(self) -> bool:
        return not self.closed and self.error is None

    def busy_s(self) -> float:
        return 0.0  # the caller's thread is the core's: nobody watches it from outside

    def submit(self, msg: CoreInput) -> None:
        self.inbox.append(msg)

    def next_outputs(self) -> CoreOutputs:
        """One round: the inputs queued so far, then one iteration when there is work. A
        failure of the engine is raised (and the client is dead; an interrupt is raised alone:
        the caller's ``SyncClient`` aborts what it left)."""
        msgs, self.inbox = self.inbox, []
        try:
            outs, _ = self.core.round(msgs)
        except Exception as e:  # raised to the caller, who reports it
            self.error = e
            raise
        return outs

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Abort what runs (its last iterations) and close the engine (its ranks too)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.error is None:
                self.core.round(self.inbox + [Shutdown()])
        finally:
            self.inbox = []
            self.core.engine.close()
