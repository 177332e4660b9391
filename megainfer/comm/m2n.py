"""Both directions between attention ranks (M) and expert ranks (N), as two channels.

``M2N.a2e`` (attention -> experts, ``dispatch_spec``): one message per (attention rank, expert
rank, layer, micro-batch), empty when no token goes there. ``M2N.e2a`` (experts -> attention,
``combine_spec``): the partial sums. Callers send and receive on the channels themselves
(``m2n.a2e.send``, ``m2n.e2a.recv``, ...); the runtime's ``AttentionExchange`` /
``ExpertExchange`` are the two ends. Control messages (stop, rebalance) go down ``a2e`` on the
stream the receiver would read next, so an expert loop ``recv -> kind?`` sees them in order.
"""
from __future__ import annotations

from typing import Optional

import torch

from megainfer.comm import spec as S
from megainfer.comm.channel import Channel
from megainfer.comm.slot import Message, SendHandle
from megainfer.comm.transport import Transport
from megainfer.comm.wait import WaitPolicy


def dispatch_spec(capacity: int, hidden: int, top_k: int, dtype: torch.dtype) -> S.MessageSpec:
    """Tokens for one expert rank: hidden [n, H], topk ids [n, k] int32, weights [n, k] f32."""
    return S.MessageSpec.of(capacity, hidden=((hidden,), dtype), topk_ids=((top_k,), torch.int32),
                            topk_weights=((top_k,), torch.float32))


def combine_spec(capacity: int, hidden: int, dtype: torch.dtype) -> S.MessageSpec:
    """Partial sums back to one attention rank: out [n, H]."""
    return S.MessageSpec.of(capacity, out=((hidden,), dtype))


def make_transports(kind: str, comm=None, fabric=None, rank: int = 0,
                    device=None) -> tuple[Transport, Transport]:
    """(dispatch transport, combine transport) for ``kind`` in auto | mpi | cuda_ipc | nccl |
    loopback, moving tensors of ``device`` (default cpu); see ``megainfer.comm.select``."""
    if kind == "loopback":
        t = fabric.endpoint(rank)
        return t, t
    if kind == "mpi" and (device is None or torch.device(device).type == "cpu"):
        from megainfer.comm.mpi import MpiTransport  # the CPU path: no identity exchange
        t = MpiTransport(comm)
        return t, t
    if kind == "nccl" and device is None:  # (before devices were named: this rank's GPU)
        from megainfer.comm.nccl import NcclTransport
        return NcclTransport(comm), NcclTransport(comm)
    from megainfer.comm.select import make_device_transports
    return make_device_transports(kind, comm, device if device is not None else "cpu")


class M2N:
    def __init__(self, transports: tuple[Transport, Transport], attn_ranks: list[int],
                 expert_ranks: list[int], dispatch: S.MessageSpec, combine: S.MessageSpec, *,
                 micro_batches: int = 1, streams: Optional[int] = None, depth: int = 2,
                 wait: WaitPolicy = WaitPolicy()):
        """``streams`` tags per direction (default: one per micro-batch); ``depth`` messages
        in flight per (peer, stream) before a sender waits for its oldest to leave."""
        td, tc = transports
        self.transports = (td, tc)
        streams = streams or micro_batches
        self.attn_ranks, self.expert_ranks = list(attn_ranks), list(expert_ranks)
        self.a2e = Channel(td, attn_ranks, expert_ranks, dispatch, streams=streams,
                           depth=depth, wait=wait, name="a2e")
        self.e2a = Channel(tc, expert_ranks, attn_ranks, combine, streams=streams,
                           depth=depth, wait=wait, name="e2a")

    def stop(self, *, iteration: int, layer: int, micro_batch: int) -> list[SendHandle]:
        """Tell every expert rank to leave its loop (a STOP on the next stream it reads)."""
        return [self.a2e.send_control(p, S.KIND_STOP, iteration=iteration, layer=layer,
                                      micro_batch=micro_batch) for p in self.expert_ranks]

    def close(self) -> None:
        self.a2e.close()
        self.e2a.close()

    def close_transports(self) -> None:
        """Collective: close each transport once (after ``close``); frees device buffers,
        IPC mappings and communicators."""
        for t in {id(t): t for t in self.transports}.values():
            t.close()


def wait_all(handles: list) -> list[Optional[Message]]:
    """Wait on every handle, in order; receive handles give their Message, sends None."""
    return [h.wait() for h in handles]
