"""This process's place in the launch, read from the MPI launcher's environment (no MPI init)."""
from __future__ import annotations

import os

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
