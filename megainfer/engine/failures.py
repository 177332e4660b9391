"""Engine failures: an engine core that cannot serve any more ends every request with an
``EngineDeadError`` (``RankLostError`` when a rank of the runtime died or stopped answering,
``CoreStartError`` when a child job's ranks did not start). Bad requests are
``engine/errors.py``'s."""
from __future__ import annotations

from typing import Optional


class EngineDeadError(RuntimeError):
    """The engine core stopped (shut down, or its loop raised): no request can run."""


def core_died(error: BaseException) -> EngineDeadError:
    """What a caller waiting on an engine core raises when the core died of ``error``: the
    error itself when it says so already (``RankLostError``, ...), else one naming it (raise
    it ``from error``)."""
    if isinstance(error, EngineDeadError):
        return error
    return EngineDeadError(f"engine core died: {error!r}")


def core_not_running(why: Optional[BaseException]) -> EngineDeadError:
    """A request to a core that stopped (``why``; None: shut down)."""
    return EngineDeadError(f"engine core is not running ({why or 'shut down'})")


class RankLostError(EngineDeadError):
    """A rank of the distributed runtime died or stopped answering: ``rank`` and ``role`` name
    it (None when nobody could tell which)."""

    def __init__(self, message: str, rank: Optional[int] = None, role: Optional[str] = None):
        super().__init__(message)
        self.rank, self.role = rank, role

    @classmethod
    def naming(cls, rank: int, role: Optional[str], what: str) -> "RankLostError":
        """The one wording of a lost rank, wherever it is noticed: ``rank R ROLE WHAT``."""
        who = f"rank {rank}" if role is None else f"rank {rank} {role}"
        return cls(f"{who} {what}", rank, role)

    def __reduce__(self):  # picklable with its fields (it crosses processes)
        return (type(self), (str(self), self.rank, self.role))


class CoreStartError(EngineDeadError):
    """The ranks of a child job started from a plain script (``core_client.spawn``) did not
    start: a rank failed, exited or timed out; the message carries the job's last output
    lines."""



__all__ = ["EngineDeadError", "RankLostError", "CoreStartError", "core_died", "core_not_running"]
