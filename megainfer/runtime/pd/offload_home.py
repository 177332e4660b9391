"""An offloaded request's return home (``pd.offload``): its KV moves from the prefill rank's
offload pool into its decode replica's blocks, and it decodes locally from then on.

Rank 0 decides it (``offload_policy.OffloadLedger``: a request the policy would offload finds
the pool of its prefill rank short, and requests decoding from that pool fit their decode
replicas' KV) and puts ``messages.OffloadHome`` in the decode replica's next ``Go``. Between two
steps every TP rank of that replica (``bring_home``) reserves blocks for the tokens computed so
far, posts the receives of a KV transfer (``kv_stream.KVReceiver``: same tags, layout and
segments as a prefill handoff), sends ``messages.OffloadReturn`` to the prefill rank after the
request's last ``OffloadQKV`` (same tag, so in order), waits (bounded, naming the prefill rank)
and places the layers. The prefill rank (``HomeSender``, from ``OffloadPool.serve``) sends the
slice's layers from the pool and frees the blocks once every decode TP rank's slice went. A
decode replica with too few free blocks preempts the request instead (it recomputes locally, as
any preempted request; the pool is released as for one): either way the pool gets its room.
docs/pd.md, "Decode attention offloaded to the prefill ranks".
"""
from __future__ import annotations

import time
from typing import Optional

from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.runtime import tags
from megainfer.runtime.control import RankFailure
from megainfer.runtime.messages import OffloadReturn
from megainfer.runtime.pd.kv_segments import Segments, gather_blocks, host_bytes, kv_tag


def bring_home(engine, client, receiver, xfer: int) -> Optional[bool]:
    """Transfer ``xfer``'s request home on this decode TP rank: True when its KV came, False
    when the blocks were short (preempted: it recomputes here), None when it is not offloaded
    here (finished or preempted meanwhile: its pool blocks were released already)."""
    seq = client.seq_of(xfer)
    req = None if seq is None else next(
        (r for r in engine.scheduler.running if r.seq_id == seq), None)
    if req is None:
        return None
    src, _ = client.by_seq[seq]
    n = req.num_computed_tokens  # the KV the pool holds: every token before the next one
    if not engine.blocks.take_home(req, n):
        engine.scheduler.preempt(req)  # releases the pool (RemoteKVBlocks.free_request)
        return False
    bs = engine.cache_config.block_size
    inc = receiver.post(xfer, src, -(-n // bs), req.request_id)
    client.outbox.post(OffloadReturn(xfer, n, client.part), src, tags.OFFLOAD_QKV)
    receiver.wait(inc)
    receiver.scatter(inc, engine.kv_caches, req.block_table)
    client.came_home(seq)
    return True


class HomeSender:
    """A prefill rank's side: each ``OffloadReturn`` -> its slice's layers sent (non-blocking)
    from the pool's cache; the request's pool blocks freed once all ``parts`` slices went."""

    def __init__(self, comm: MPI.Comm, kind: str, num_layers: int, segs: Segments,
                 block_size: int, parts: int, me: str, policy: WaitPolicy):
        self.comm, self.kind, self.L, self.segs, self.bs = comm, kind, num_layers, segs, block_size
        self.parts, self.me, self.policy = parts, me, policy
        self.tag_ub = comm.Get_attr(MPI.TAG_UB)
        self.sent: dict[int, int] = {}  # xfer -> slices sent so far
        self.inflight: list = []  # (decode rank, xfer, MPI requests, buffers kept alive)
        self.returned = 0  # requests sent home
        self.bytes_sent = 0

    def send(self, msg: OffloadReturn, dest: int, kv: list, table: list) -> bool:
        """Post slice ``msg.part``'s layers (``kv``: that slice's cache per layer, ``table``: the
        request's pool blocks) to decode rank ``dest``; True when every slice has gone (the
        blocks may be freed: the buffers hold copies)."""
        n, nblk = msg.num_tokens, -(-msg.num_tokens // self.bs)
        reqs, bufs = [], []
        for layer, cache in enumerate(kv):
            for j in range(self.segs.count(nblk)):
                b0, b1 = self.segs.span(j, nblk)
                g = gather_blocks(cache, self.kind, table[b0:b1], n - b0 * self.bs)
                if self.kind == "gqa":
                    g = g.transpose(0, 1)  # block-major [n, 2, BS, H, D], as kv_stream sends
                buf = host_bytes(g)
                bufs.append(buf)
                tag = kv_tag(msg.xfer, layer, j, self.L, self.segs, self.tag_ub)
                reqs.append(self.comm.Isend([buf, MPI.BYTE], dest=dest, tag=tag))
                self.bytes_sent += buf.nbytes
        self.inflight.append((dest, msg.xfer, reqs, bufs))
        self.sent[msg.xfer] = self.sent.get(msg.xfer, 0) + 1
        if self.sent[msg.xfer] < self.parts:
            return False
        del self.sent[msg.xfer]
        self.returned += 1
        return True

    def poll(self) -> None:
        self.inflight = [x for x in self.inflight if not MPI.Request.Testall(x[2])]

    def drain(self) -> None:
        """Wait (bounded) for every send posted; names the decode rank."""
        t0 = time.perf_counter()
        for dest, xfer, reqs, _ in self.inflight:
            waited = wait_until(lambda: MPI.Request.Testall(reqs), self.policy)
            if waited < 0:
                raise RankFailure(self.me, dest, f"offloaded request {xfer}'s KV going home",
                                  time.perf_counter() - t0)
        self.inflight = []
