"""This process's place in the launch, read from the MPI launcher's environment (no MPI init),
and its tie to the process that started it (``parent_death_signal``)."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1

_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_SIZE")
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID")
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK",
                    "SLURM_LOCALID", "LOCAL_RANK")


def _first_int(names) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v is not None and v.strip().isdigit():
            return int(v)
    return None


def world_size() -> int:
    return _first_int(_SIZE_VARS) or 1


def world_rank() -> int:
    return _first_int(_RANK_VARS) or 0


def local_ranks() -> int:
    """Processes of this launch on this host (they share its cores)."""
    return _first_int(_LOCAL_SIZE_VARS) or 1


def local_rank() -> int:
    """This process's index among the launch's processes on this host (it picks its GPU)."""
    return _first_int(_LOCAL_RANK_VARS) or 0


def parent_death_signal(parent: int, sig: int = signal.SIGTERM):
    """A function that makes the calling process receive ``sig`` when its parent (``parent``,
    the thread that forked it) dies, and exit at once if ``parent`` is gone already; None where
    the platform has no such thing (only Linux has ``prctl``). Made before a fork, called in
    the child (``preexec_fn``), or made and called by a process about its own parent."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody would signal
            os._exit(1)
    return arm
