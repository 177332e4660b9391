"""Every message that crosses between a frontend's client and an engine core, in one place.

The core's inputs (``AddRequest``, ``AbortRequest``, ``Shutdown``, a live planner's
``OrderReplan``) go in between iterations;
each round of the core comes out as one ``CoreOutputs``: a ``RequestUpdate`` per request that
changed (its samples' new tokens, ``SampleDelta``, and once its final ``RequestOutput``), the
core's ``CoreStats`` or the error it died of. Over a child job's socket also: ``JobTree`` first;
rank 0 answers ``Launched``, then ``Ready`` or ``StartFailed``, and ``Heartbeat`` whenever it
sent nothing for ``HEARTBEAT_S``. Invariant: every exception that crosses is an
``EngineDeadError`` (``RankLostError`` when a rank is to blame), so it unpickles in the script
whatever the child imported. Messages between ranks are ``runtime/messages.py``'s.
docs/python_api.md, "Ranks started from a plain script"."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

from megainfer.engine.failures import EngineDeadError
from megainfer.engine.intake import TokenizedPrompt
from megainfer.engine.outputs import RequestOutput, SampleDelta
from megainfer.engine.sampling_params import SamplingParams
from megainfer.engine.stats import CoreStats


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: TokenizedPrompt
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    """Abort every unfinished request (their outputs go out) and stop the loop."""


@dataclass(frozen=True)
class OrderReplan:
    """A live planner's switch (``replan.policy=planner``): every rank to ``label``
    (``aNeMmK``) from the next iteration; ``reason``: the decision's, logged and
    recorded with the switch."""

    label: str
    reason: str


CoreInput = Union[AddRequest, AbortRequest, Shutdown, OrderReplan]


@dataclass
class RequestUpdate:
    """What one iteration (or one input) changed for one request."""

    request_id: str
    new_tokens: list[SampleDelta] = field(default_factory=list)
    output: Optional[RequestOutput] = None  # the last update of a request: finished, aborted
    # ("abort") or refused (finish_reason "error", ``error`` naming the culprit)


@dataclass
class CoreOutputs:
    """One batch of updates from the core's loop; ``error`` set when the loop died of it (every
    unfinished request ends with it)."""

    updates: list[RequestUpdate] = field(default_factory=list)
    error: Optional[BaseException] = None
    stats: Optional[CoreStats] = None  # what the core measured since its last outputs


# the child's environment: the authkey of the socket (never on a command line) and the log level
AUTHKEY_ENV = "MEGAINFER_CORE_AUTHKEY"
LOG_LEVEL_ENV = "MEGAINFER_CORE_LOG_LEVEL"
HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class RankInfo:
    """One rank of the child job: its process and its role's log label (``[expert 0]``)."""

    rank: int
    pid: int
    role: str


def gather_roster(comm, role: str) -> tuple[RankInfo, ...]:
    """Collective over ``comm``: every rank's ``RankInfo`` (``role``: this rank's log label), in
    rank order on rank 0, () on the others. The one roster of a job: the launcher's, the
    server's and a child job's (``Launched``)."""
    got = comm.gather(RankInfo(comm.Get_rank(), os.getpid(), role), root=0)
    return tuple(got) if got else ()


_ROSTER_ENTRY = re.compile(r"(\d+) (\[[^]]*\]) pid (\d+)")


def roster_text(ranks: Iterable[RankInfo]) -> str:
    """``0 [attn dp0 tp0] pid 9455, 1 [expert 0] pid 9456``: what a process manager's "PID n
    died" is read against (``parse_roster`` reads it back)."""
    return ", ".join(f"{r.rank} {r.role} pid {r.pid}" for r in ranks)


def parse_roster(text: str) -> dict[int, RankInfo]:
    """``roster_text``'s entries in ``text`` -> {rank: RankInfo}."""
    return {int(r): RankInfo(int(r), int(p), role) for r, role, p in _ROSTER_ENTRY.findall(text)}


@dataclass(frozen=True)
class Launched:
    """Every rank has started, resolved its job and knows its role (ranks in rank order); the
    engine is being built."""

    ranks: tuple[RankInfo, ...]


@dataclass(frozen=True)
class Ready:
    """Rank 0's engine core runs: inputs are accepted. ``timeout_s``: the job's
    ``comm.timeout_s`` (rank 0 silent for longer is hung)."""

    log_prefix: str
    timeout_s: float


@dataclass(frozen=True)
class Heartbeat:
    """Rank 0's process runs (sent when it had nothing else to send)."""


@dataclass(frozen=True)
class StartFailed:
    """Rank 0 could not start its part (``error`` says why; its traceback is in its log)."""

    error: EngineDeadError
