"""The engine core's loop on a background thread of this process (``AsyncLLM``; ``LLM`` as
rank 0 of an ``mpiexec`` launch; rank 0 of a child job): inputs through a queue, each round's
outputs to a callback, blocking on the queue while there is no work."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

from .core import EngineCore
from .messages import CoreInput, CoreOutputs, Shutdown

log = logging.getLogger("megainfer.engine_core")


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
