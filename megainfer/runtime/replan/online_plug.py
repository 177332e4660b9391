"""Re-planning in rank 0's online engine (``runtime_engine.RuntimeEngine``, the engine of
``LLM(deploy=...)``, ``AsyncLLM`` and ``megainfer-serve``; docs/replan.md, "Online").

``REPLAN.online`` makes this rank 0's ``OnlinePlug``: its ``ReplanController`` is the loop's
hook, as in a batch job; when the hook ends an iteration with an order, ``between`` sends it
to every rank, every rank switches (``runner.order_switch``: the other ranks run ``_serve``,
as in a batch job) and rank 0's loop over its kept engine resumes with the old loop's online
state (``ReplicaLoop.continue_from``): requests not handed out, aborts held back, which
requests are open. ``order``: the live planner's switch (the frontend's, through the engine
core's ``OrderReplan``), ordered by the controller like a forced one. ``drain`` (the core's shutdown began) stops ordering switches. ``close``,
after the iteration that stopped every rank's loop, sends the end (a None order) so every
rank's ``_serve`` returns."""
from __future__ import annotations

import logging
from dataclasses import replace

from megainfer.runtime.replan.runner import ReplanController, order_switch

log = logging.getLogger("megainfer.runtime")
KEEP_DECISIONS = 1024  # measured decisions kept online (a server runs on)


class OnlineReplanner:
    def __init__(self, r):
        self.rank = r
        self.ctl = ReplanController(r)
        r.loop.replan_hook = self.ctl.hook
        self.switching = False

    def between(self, loop):
        """After an iteration: an order ended the loop's phase -> every rank switches, and the
        loop that follows (rank 0 keeps its engine and its requests) iterates on."""
        decisions = self.rank.replan_decisions
        del decisions[:-KEEP_DECISIONS]
        if loop.order is None:
            return loop
        order = replace(loop.order, stream=loop.stream)  # the resumed loops stream as before
        self.switching = True
        try:
            order_switch(self.rank, self.ctl, order)
        finally:
            self.switching = False
        new = self.rank.loop
        new.resume_online()
        log.info("%s re-plan %s done; serving on", new.role.label, order.label)
        return new

    def order(self, label: str, reason: str) -> None:
        """The live planner's switch (``replan.policy=planner``): the controller orders it at
        the next iteration."""
        self.ctl.order(label, reason)

    def drain(self) -> None:
        """The engine core shuts down (its last iterations end the aborted requests): a switch
        then would only delay the end."""
        self.ctl.draining = True

    def close(self) -> None:
        order_switch(self.rank, self.ctl, None)
        self.ctl.finish()
