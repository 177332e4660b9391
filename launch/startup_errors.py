"""One error report per failed start-up, not one per rank.

Under mpiexec every rank composes the same config and resolves the same settings, so a bad key
or value fails identically on each. The ranks agree on their failures (one ``allgather`` of
each rank's message or None, at the same point of every rank's start-up: after
``settings_from_config``, or in ``main`` when Hydra refused the command line) and rank 0 prints
each distinct message once, tagged with the ranks that had it unless all did; the others stay
silent and every rank exits with the failure's code. World size 1 prints its message directly.
While Hydra composes, each rank's stderr is held back (``HeldStderr``), so a composition error
is printed by rank 0 alone. docs/engine.md, "Bad input"."""
from __future__ import annotations

import io
import sys
from typing import Optional

from megainfer.engine_core.launch_env import world_rank, world_size


class HeldStderr:
    """``sys.stderr`` into a buffer until ``release`` (a no-op for world size 1)."""

    def __init__(self):
        self.active = world_size() > 1
        self.buffer = io.StringIO()
        self.real = sys.stderr
        self.released = False

    def __enter__(self) -> "HeldStderr":
        if self.active:
            sys.stderr = self.buffer
        return self

    def release(self) -> str:
        """Restore the real stderr; the text held back so far."""
        self.released = True
        if sys.stderr is self.buffer:
            sys.stderr = self.real
        return self.buffer.getvalue()

    def __exit__(self, *exc) -> None:
        self.release()


def agree(message: Optional[str]) -> list[Optional[str]]:
    """Every rank's start-up failure message (None: that rank started fine), in rank order."""
    if world_size() < 2:
        return [message]
    from mpi4py import MPI  # here only: importing it starts MPI, which world size 1 never does
    return MPI.COMM_WORLD.allgather(message)


def report(messages: list[Optional[str]]) -> bool:
    """Print (rank 0) each distinct failure once; True when any rank failed."""
    if world_rank() == 0:
        by_text: dict[str, list[int]] = {}
        for r, m in enumerate(messages):
            if m is not None:
                by_text.setdefault(m, []).append(r)
        for text, ranks in by_text.items():
            if len(ranks) < len(messages):  # not every rank: say which
                first, _, rest = text.partition("\n")
                text = f"{first} (rank{'s' if len(ranks) > 1 else ''} " \
                       f"{', '.join(map(str, ranks))})" + (f"\n{rest}" if rest else "")
            sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()
    return any(m is not None for m in messages)


def config_error_line(e: Exception) -> str:
    return f"[launch] error: {type(e).__name__}: {e}"
