"""What a frontend raises when its engine core cannot serve any more."""
from __future__ import annotations

from typing import Optional


class EngineDeadError(RuntimeError):
    """The engine core stopped (shut down, or its loop raised): no request can run."""


class RankLostError(EngineDeadError):
    """A rank of the distributed runtime died or stopped answering: ``rank`` and ``role`` name
    it (None when nobody could tell which)."""

    def __init__(self, message: str, rank: Optional[int] = None, role: Optional[str] = None):
        super().__init__(message)
        self.rank, self.role = rank, role

    def __reduce__(self):  # picklable with its fields (it crosses processes)
        return (type(self), (str(self), self.rank, self.role))


class CoreStartError(EngineDeadError):
    """The ranks of a spawned child job did not start (a rank failed, exited or timed out);
    the message carries the child job's last output lines."""
