"""``comm.transport`` -> the transports of a job, and why a choice cannot work.

=========  ==============================================================================
mpi        CPU tensors: ``MpiTransport``; device tensors: ``StagingTransport`` (pinned host)
cuda_ipc   every rank on one node (several may share a GPU): ``CudaIpcTransport``
nccl       one rank per GPU, any nodes: ``NcclTransport``, one communicator per direction
auto       cpu: mpi. cuda: cuda_ipc when every rank is on one node, else nccl (one job
           does not mix the two)
=========  ==============================================================================

Invariant: every check is collective and fails on every rank alike at start-up, naming the
ranks and the reason. docs/comm.md, "Device tensors: which transport, and what it costs"."""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from megainfer.comm.errors import CommError, TransportChoiceError
from megainfer.comm.transport import Transport

log = logging.getLogger("megainfer.comm")
KINDS = ("auto", "mpi", "cuda_ipc", "nccl", "loopback")
MULTI_RANK_GPU_NCCL = 23000  # NCCL 2.30.0: NCCL_MULTI_RANK_GPU_ENABLE


def pair_plan(hosts: list[str]) -> dict[tuple[int, int], str]:
    """``auto`` on cuda: (rank a, rank b) -> its transport: ``cuda_ipc`` when all ranks share
    one host, else ``nccl`` for every pair."""
    n, one = len(hosts), len(set(hosts)) == 1
    return {(a, b): "cuda_ipc" if one else "nccl" for a in range(n) for b in range(n)}


def shared_gpus(hosts: list[str], gpus: list[str]) -> list[tuple[str, str, list[int]]]:
    """(host, gpu, ranks) for every GPU that more than one rank uses."""
    seen: dict = {}
    for r, key in enumerate(zip(hosts, gpus)):
        seen.setdefault(key, []).append(r)
    return [(h, g, rs) for (h, g), rs in seen.items() if len(rs) > 1]


def check_nccl(hosts: list[str], gpus: list[str], version: Optional[int], env=os.environ) -> None:
    """Raise unless NCCL can hold these ranks: one per GPU, or the multi-rank-per-GPU mode."""
    shared = shared_gpus(hosts, gpus)
    if not shared:
        return
    where = "; ".join(f"ranks {rs} on GPU {g} of {h}" for h, g, rs in shared)
    if env.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" and version and version >= MULTI_RANK_GPU_NCCL:
        log.warning("[comm] NCCL %d with NCCL_MULTI_RANK_GPU_ENABLE=1: trying ranks that share a "
                    "GPU (%s)", version, where)
        return
    raise TransportChoiceError(
        f"comm.transport=nccl: NCCL refuses a communicator that holds one GPU twice ({where}; "
        f"NCCL {version or 'not found'}); use comm.transport=cuda_ipc or mpi on one node, or one "
        f"rank per GPU (NCCL_MULTI_RANK_GPU_ENABLE=1 needs NCCL >= 2.30)")


def resolve(kind: str, device: torch.device, hosts: list[str], gpus: list[str]) -> str:
    """The transport a job of these ranks uses: ``mpi``, ``cuda_ipc`` or ``nccl``."""
    if kind not in KINDS:
        raise TransportChoiceError(f"comm.transport={kind!r}: must be one of {KINDS}")
    cuda = device.type == "cuda"
    if kind in ("cuda_ipc", "nccl") and not cuda:
        raise TransportChoiceError(f"comm.transport={kind}: moves device tensors; this job runs "
                                   f"on {device} (use mpi or auto, or deploy.device=cuda)")
    if kind == "auto":
        if not cuda:
            return "mpi"
        return "cuda_ipc" if len(set(hosts)) == 1 else "nccl"
    return kind


def _identity(comm, device: torch.device) -> tuple[list[str], list[str]]:
    from mpi4py import MPI
    gpu = ""
    if device.type == "cuda":
        from megainfer.comm.cudart import runtime
        gpu = runtime().pci_bus_id(device.index if device.index is not None
                                   else torch.cuda.current_device())
    ids = comm.allgather((MPI.Get_processor_name(), gpu))
    return [h for h, _ in ids], [g for _, g in ids]


def device_path_kind(choice: str, device, transport: str) -> Optional[str]:
    """A collective's path key (``comm.tp_collectives``, ``comm.eplb_moves``: ``auto``, ``mpi``,
    or the device path) -> the transport kind it runs on, or None for MPI through host memory.
    ``auto``: ``cuda_ipc`` on cuda when the job's transport is ``auto`` or ``cuda_ipc`` (one
    node), else the host; the device path: ``cuda_ipc`` on cuda (its ranks must share a node;
    the transport's start-up check says so otherwise), the MPI transport on cpu (the stand-in
    the tests run)."""
    if choice == "mpi":
        return None
    cuda = torch.device(device).type == "cuda"
    if choice == "auto":
        return "cuda_ipc" if cuda and transport in ("auto", "cuda_ipc") else None
    return "cuda_ipc" if cuda else "mpi"


def make_device_transports(kind: str, comm, device) -> tuple[Transport, Transport]:
    """(dispatch, combine) transports for ``kind`` on ``device`` (collective over ``comm``)."""
    device = torch.device(device)
    hosts, gpus = _identity(comm, device)
    how = resolve(kind, device, hosts, gpus)
    me = comm.Get_rank()
    if kind == "auto" and device.type == "cuda" and me == 0:
        plan = pair_plan(hosts)
        log.info("[comm] transport auto: %s", ", ".join(
            f"{a}->{b} {t}" for (a, b), t in sorted(plan.items()) if a != b) or "one rank")
    if how == "mpi":
        if device.type == "cuda":
            from megainfer.comm.staging import StagingTransport
            t = StagingTransport(comm, device)
        else:
            from megainfer.comm.mpi import MpiTransport
            t = MpiTransport(comm)
        return t, t
    if how == "cuda_ipc":
        from megainfer.comm.cuda_ipc import CudaIpcTransport
        t = CudaIpcTransport(comm, device)
        return t, t
    from megainfer.comm.nccl import NcclTransport, nccl_version
    try:
        version = nccl_version()
    except CommError:
        version = None
    check_nccl(hosts, gpus, version)
    return NcclTransport(comm, device), NcclTransport(comm, device)
