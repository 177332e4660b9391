"""What crosses the socket between a ``SpawnedCore`` (the script's process) and rank 0 of the
``mpiexec`` child job it started (``rank_job``), besides the engine core's own messages.

Script -> rank 0: the ``JobTree``, then the core's inputs (``AddRequest``, ``AbortRequest``,
``Shutdown``). Rank 0 -> script: ``Launched`` (every rank is up and has its role), then
``Ready`` (rank 0's engine is built) or ``StartFailed``, then ``CoreOutputs``, and
``Heartbeat`` whenever rank 0 has sent nothing for ``HEARTBEAT_S`` (a rank 0 that goes silent
for ``comm.timeout_s`` is declared hung). Every exception
that crosses is an ``EngineDeadError`` (``RankLostError`` when a rank is to blame), so it
unpickles in the script whatever the child imported."""
from __future__ import annotations

from dataclasses import dataclass

from megainfer.engine.errors import EngineDeadError

# the child's environment: the authkey of the socket (never on a command line) and the log level
AUTHKEY_ENV = "MEGAINFER_CORE_AUTHKEY"
LOG_LEVEL_ENV = "MEGAINFER_CORE_LOG_LEVEL"
HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class RankInfo:
    """One rank of the child job: its process and its role's log tag (``[expert 0]``)."""

    rank: int
    pid: int
    role: str


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
